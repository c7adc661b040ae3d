"""Reference solution, chapter 11: whom the "priority" policy preempts when blocks run out."""


def my_preempt_victim(running, outranked_by):
    if not running:
        return None
    victim = max(running, key=lambda seq: seq.priority_key)  # lowest priority, newest among equals
    if outranked_by is None or victim.priority_key > outranked_by.priority_key:
        return victim
    return None  # a waiting request only pushes out work it outranks; otherwise it waits
