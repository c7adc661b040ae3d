"""Reference solution, chapter 01: first come, first served."""

from collections import deque


def my_enqueue(waiting: deque, request, preempted: bool) -> None:
    if preempted:
        waiting.appendleft(request)  # older than everyone waiting: back to the head
    else:
        waiting.append(request)  # a new arrival joins the tail
