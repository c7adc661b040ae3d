"""Small helpers over recorded traces (pure; no ipywidgets here)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from minivllm.engine.trace import StepTrace


def relabel_requests(steps: Sequence[StepTrace], names: Mapping[str, str]) -> list[StepTrace]:
    """Copies of `steps` with request ids renamed by `names` (others kept), e.g. a server's ids
    ("cmpl-3f2a...-0") to the clients that sent them, so that figures and pages read better."""

    def rn(rid: str) -> str:
        return names.get(rid, rid)

    def by_request(d: dict) -> dict:
        return {rn(rid): v for rid, v in d.items()}

    return [dataclasses.replace(
        t, scheduled=[dataclasses.replace(e, request_id=rn(e.request_id)) for e in t.scheduled],
        preempted=[rn(r) for r in t.preempted], finished=by_request(t.finished),
        allocated=by_request(t.allocated), cache_hits=by_request(t.cache_hits),
        freed=by_request(t.freed), block_tables=by_request(t.block_tables),
        waiting=[rn(r) for r in t.waiting], running=[rn(r) for r in t.running]) for t in steps]
