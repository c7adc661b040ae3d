"""The speculation stepper: drafts, verdicts and the target's own tokens, read from a real engine's
trace."""

import re

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from minivllm import LLM, SamplingParams, widgets  # noqa: E402
from minivllm.engine.trace import ScheduledEntry, StepTrace  # noqa: E402
from tests.conftest import build_checkpoint, build_noisy_copy  # noqa: E402

PROMPT = [5, 6, 7, 8, 9, 10, 11]


class Letters:
    """A stand-in tokenizer: token i is the letter chr(ord('a') + i % 26), so texts are easy to
    read."""

    def decode(self, ids):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def verdicts(page: str) -> list[str]:
    """The verdict under each cell of the round's table, in order."""
    table = page.split('class="minivllm-spec">')[1].split("</table>")[0]
    return [re.sub(r"<[^>]+>", "", td.split("<br>")[1]) for td in re.findall(r"<td[^>]*>(.*?)</td>",
                                                                             table)]


def cells_text(page: str) -> list[str]:
    table = page.split('class="minivllm-spec">')[1].split("</table>")[0]
    return [re.sub(r"<[^>]+>", "", td.split("<br>")[0]) for td in re.findall(r"<td[^>]*>(.*?)</td>",
                                                                             table)]


def round_of(drafted, accepted, new, step=7, before=(1, 2)):
    entry = ScheduledEntry("r", 1 + len(drafted), "decode", 10, new[-1] if new else None,
                           list(drafted), accepted, list(new))
    trace = StepTrace(step, 0.0, [entry], [], {}, {}, {}, {}, {"r": [0]}, [], ["r"], 3, 4)
    first = StepTrace(step - 1, 0.0, [ScheduledEntry("r", 9, "prefill", 0, before[-1], [], 0,
                                                     list(before))],
                      [], {}, {}, {}, {}, {"r": [0]}, [], ["r"], 3, 4)
    return widgets.spec_rounds([first, trace], "r")


def test_the_materials_example_disagreement_at_token_3():
    """Five drafts; the target disagrees at the third: two kept, the third corrected, two
    discarded."""
    first, rnd = round_of([0, 1, 2, 3, 4], 2, [0, 1, 25])
    assert first.outcome == "plain" and first.kind == "prefill" and rnd.output_before == [1, 2]
    assert (rnd.outcome == "correction" and rnd.rejected_index == 2 and rnd.target_token == 25
            and rnd.num_reveals == 3)
    page = widgets.speculation_html(rnd, Letters(), prompt_token_ids=[7, 7])
    assert cells_text(page) == ["a", "b", "c", "d", "e"]
    assert verdicts(page) == ["accepted", "accepted", "rejected → z", "discarded", "discarded"]
    assert ("disagreement at draft 3: the first 2 kept, draft 3 corrected by the target, 2 "
            "discarded" in page)
    # prompt + output, then the new tokens
    assert "context: <code>hhbc</code>" in page and ">abz</code></span>" in page
    assert "5 drafted, 2 accepted, 3 appended" in page


def test_reveals_go_one_token_at_a_time():
    _, rnd = round_of([0, 1, 2, 3, 4], 2, [0, 1, 25])
    pages = [widgets.speculation_html(rnd, Letters(), revealed=j) for j in range(4)]
    assert verdicts(pages[0]) == ["pending"] * 5
    assert verdicts(pages[1]) == ["accepted"] + ["pending"] * 4
    assert verdicts(pages[2]) == ["accepted", "accepted"] + ["pending"] * 3
    assert verdicts(pages[3]) == ["accepted", "accepted", "rejected → z", "discarded", "discarded"]
    assert "revealed 1 of 3 appended tokens" in pages[1] and ">a</code></span>" in pages[1]
    assert "disagreement" in pages[3] and "press Step" not in pages[3]


def test_all_accepted_earns_the_bonus_token():
    _, rnd = round_of([3, 4, 5], 3, [3, 4, 5, 9])
    assert rnd.outcome == "bonus" and rnd.rejected_index is None and rnd.target_token == 9
    assert (verdicts(widgets.speculation_html(rnd, Letters(),
                                              revealed=3)) == ["accepted"] * 3 + ["pending"])
    page = widgets.speculation_html(rnd, Letters())
    assert verdicts(page) == ["accepted"] * 3 + ["bonus (target)"] and cells_text(page)[-1] == "j"
    assert "all 3 drafts accepted, plus the target's bonus token: 4 tokens from one target pass" in page


def test_a_request_that_stops_on_an_accepted_draft():
    """EOS at the second draft: the engine appends two tokens although the target accepted three
    drafts."""
    _, rnd = round_of([3, 4, 5, 6], 3, [3, 4])
    assert rnd.num_reveals == 2 and rnd.target_token is None
    page = widgets.speculation_html(rnd, Letters())
    assert verdicts(page) == ["accepted", "accepted", "after the stop", "after the stop"]


def test_token_ids_without_a_tokenizer():
    _, rnd = round_of([30, 31], 0, [40])
    page = widgets.speculation_html(rnd)
    assert cells_text(page) == ["30", "31"] and verdicts(page) == ["rejected → 40", "discarded"]


@pytest.fixture(scope="module")
def spec_run(tmp_path_factory):
    """A random target and a draft that is the target with noise in its head: some drafts pass, some
    fail."""
    root = tmp_path_factory.mktemp("spec-widget")
    target = build_checkpoint("llama", root / "target")
    build_noisy_copy(target, root / "noisy")
    llm = LLM(root / "target", block_size=4, num_kv_blocks=64, speculative_model=root / "noisy",
              num_speculative_tokens=4)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": PROMPT}, {"prompt_token_ids": [3, 1, 4, 1, 5]}],
                       params, use_tqdm=False)
    return llm, out


def test_rounds_rebuild_the_output_and_the_counts(spec_run):
    llm, out = spec_run
    steps = list(llm.engine.trace)
    rounds = {rid: widgets.spec_rounds(steps, rid) for rid in ("0", "1")}
    for rid, o in zip(("0", "1"), out):
        assert [t for r in rounds[rid] for t in r.new_token_ids] == o.outputs[0].token_ids
        assert rounds[rid][0].kind == "prefill" and rounds[rid][0].outcome == "plain"
        assert sum(len(r.drafted) for r in rounds[rid]) == o.metrics.spec_num_proposed
        assert sum(r.num_accepted for r in rounds[rid]) == o.metrics.spec_num_accepted
    every = rounds["0"] + rounds["1"]
    stats = llm.engine.stats()
    assert sum(len(r.drafted) for r in every) == stats["spec_num_proposed"]
    assert ({r.outcome for r in every} >= {"bonus",
                                           "correction"}), "the noisy draft is sometimes right, sometimes not"
    for r in every:
        if r.outcome == "correction":
            assert r.new_token_ids[: r.num_accepted] == r.drafted[: r.num_accepted]
            assert r.target_token != r.drafted[r.rejected_index]
        if r.outcome == "bonus":
            assert r.new_token_ids[:-1] == r.drafted


def test_stepper_buttons_and_slider(spec_run):
    llm, out = spec_run
    stepper = widgets.SpeculationStepper(llm.engine, "0", prompt_token_ids=out[0].prompt_token_ids)
    rounds = stepper.rounds
    assert stepper.index == 0 and stepper.slider.value == 1 and stepper.slider.max == len(rounds)
    assert stepper.revealed == 0 and stepper.total.value == f"of {len(rounds)}"
    assert ("prefill: the first token" in stepper.html.value
            and verdicts(stepper.html.value) == ["pending"])
    stepper.step_button.click()
    assert verdicts(stepper.html.value) == ["target"] and "round 1 of" in stepper.html.value
    # the prefill round is complete: on to round 2, drafts shown, nothing judged
    stepper.step_button.click()
    assert stepper.index == 1 and stepper.revealed == 0
    assert verdicts(stepper.html.value) == ["pending"] * (len(rounds[1].drafted) + (rounds[1].outcome == "bonus"))
    k = next(i for i, r in enumerate(rounds) if r.outcome == "correction" and r.num_accepted >= 1)
    stepper.index = k
    rnd = rounds[k]
    assert stepper.slider.value == k + 1
    assert f"round {k + 1} of {len(rounds)} (engine step {rnd.step})" in stepper.html.value
    for j in range(1, rnd.num_reveals + 1):
        stepper.step_button.click()
        assert stepper.revealed == j
        assert (f"revealed {j} of {rnd.num_reveals}" in stepper.html.value) == (j < rnd.num_reveals)
        assert (verdicts(stepper.html.value)[: min(j, rnd.num_accepted)] == ["accepted"] * min(j,
                                                                                               rnd.num_accepted))
    page = stepper.html.value
    assert verdicts(page)[rnd.num_accepted].startswith("rejected → ")
    assert f"disagreement at draft {rnd.num_accepted + 1}" in page
    # the random checkpoint has no tokenizer: ids
    assert cells_text(page) == [str(t) for t in rnd.drafted]
    stepper.step_button.click()
    assert stepper.index == k + 1 and stepper.revealed == 0
    stepper.show_all_button.click()
    assert (stepper.revealed == rounds[k + 1].num_reveals
            and "pending" not in verdicts(stepper.html.value))
    stepper.slider.value = stepper.slider.max
    stepper.show_all_button.click()
    assert stepper.step_button.disabled  # the last round, fully shown: nothing left to step to
    stepper.step_button.click()
    assert stepper.index == len(rounds) - 1
    stepper.reset_button.click()
    assert stepper.index == 0 and stepper.revealed == 0 and "prefill" in stepper.html.value
    jump = stepper.jumps["rejection"][0]
    jump.click()
    assert rounds[stepper.index].outcome == "correction"
    assert all(r.outcome != "correction" for r in rounds[: stepper.index])


def test_stepper_on_a_recording_and_an_unknown_request(spec_run):
    llm, _ = spec_run
    steps = list(llm.engine.trace)
    stepper = widgets.SpeculationStepper(steps)
    assert stepper.request_id == "0" and len(stepper.rounds) == len(widgets.spec_rounds(steps, "0"))
    empty = widgets.SpeculationStepper(steps, "nobody")
    assert (empty.rounds == []
            and "no tokens recorded for request &#x27;nobody&#x27;" in empty.html.value)
    empty.step_button.click()
    empty.show_all_button.click()
    assert empty.index == 0


def test_relabel_requests_renames_every_mention(spec_run):
    llm, _ = spec_run
    steps = list(llm.engine.trace)
    renamed = widgets.relabel_requests(steps, {"0": "alice"})
    assert (len(renamed) == len(steps)
            and steps[0].scheduled[0].request_id == "0"), "the originals are untouched"
    assert widgets.request_ids(renamed) == ["alice", "1"]
    for old, new in zip(steps, renamed):
        assert [e.request_id for e in new.scheduled] == [("alice" if e.request_id == "0"
                                                          else e.request_id)
                                                          for e in old.scheduled]
        assert list(new.block_tables.values()) == list(old.block_tables.values())
        assert new.shared_blocks == old.shared_blocks and new.step == old.step
    assert [r.new_token_ids for r in widgets.spec_rounds(renamed, "alice")] == \
        [r.new_token_ids for r in widgets.spec_rounds(steps, "0")]
