"""Prometheus metrics and one JSON log line per finished request, both fed by the engine loop after each step.

The registry belongs to the app, not prometheus_client's global one, so two servers in one process (tests)
keep separate counts. Gauges are read from the owner's stats snapshot at scrape time; counters and histograms
are updated from step outputs, so nothing here ever touches the engine itself.
"""

from __future__ import annotations

import json
import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from minivllm.outputs import RequestOutput

request_log = logging.getLogger("minivllm.server.requests")

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.running = Gauge("minivllm_num_requests_running", "Sequences in the running batch.", registry=r)
        self.waiting = Gauge("minivllm_num_requests_waiting", "Sequences waiting to be scheduled.", registry=r)
        self.blocks_total = Gauge("minivllm_kv_blocks_total", "KV-cache blocks in the pool.", registry=r)
        self.blocks_free = Gauge("minivllm_kv_blocks_free", "KV-cache blocks no request holds (cached ones "
                                 "included: they are evictable).", registry=r)
        self.hit_rate = Gauge("minivllm_prefix_cache_hit_rate", "Prompt tokens served by the prefix cache / "
                              "prompt tokens looked up, since start.", registry=r)
        self.ttft = Histogram("minivllm_time_to_first_token_seconds", "Arrival to first output token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("minivllm_time_per_output_token_seconds", "Mean time between output tokens after "
                              "the first, per request.", buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("minivllm_e2e_request_latency_seconds", "Arrival to last output token.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.generation_tokens = Counter("minivllm_generation_tokens", "Output tokens generated.", registry=r)
        self.prompt_tokens = Counter("minivllm_prompt_tokens", "Prompt tokens of requests admitted.", registry=r)
        self.preemptions = Counter("minivllm_num_preemptions", "Sequences preempted to free blocks.", registry=r)
        self.finished = Counter("minivllm_requests_finished", "Requests finished, by why they stopped.",
                                ["finish_reason"], registry=r)
        self._first_token_seen: dict[str, bool] = {}  # request id -> TTFT already observed
        self._last: dict = {}

    def observe(self, outputs: list[RequestOutput], stats: dict) -> None:
        """Engine-loop listener: count tokens, time first tokens, and retire finished requests."""
        for key, counter in (("num_generated_tokens", self.generation_tokens),
                             ("num_preemptions", self.preemptions)):
            delta = stats[key] - self._last.get(key, 0)
            if delta > 0:
                counter.inc(delta)
        self._last = stats
        for out in outputs:
            rid = out.request_id
            if rid not in self._first_token_seen:
                self._first_token_seen[rid] = False
                self.prompt_tokens.inc(len(out.prompt_token_ids))
            ttft = out.metrics.time_to_first_token if out.metrics else None
            if ttft is not None and not self._first_token_seen[rid]:
                self._first_token_seen[rid] = True
                self.ttft.observe(ttft)
            if out.finished:
                del self._first_token_seen[rid]
                self._retire(out)

    def _retire(self, out: RequestOutput) -> None:
        m = out.metrics
        num_out = max((len(c.token_ids) for c in out.outputs), default=0)
        total = m.finished_time - m.arrival_time if m and m.finished_time else None
        if m and m.first_token_time is not None and m.finished_time and num_out > 1:
            self.tpot.observe((m.finished_time - m.first_token_time) / (num_out - 1))
        if total is not None:
            self.e2e.observe(total)
        reasons = [c.finish_reason or "abort" for c in out.outputs]
        for reason in reasons:
            self.finished.labels(finish_reason=reason).inc()
        if request_log.isEnabledFor(logging.INFO):
            ttft = m.time_to_first_token if m else None
            request_log.info(json.dumps({
                "request_id": out.request_id, "prompt_tokens": len(out.prompt_token_ids),
                "output_tokens": sum(len(c.token_ids) for c in out.outputs), "cached_tokens": out.num_cached_tokens,
                "ttft_s": _round(ttft), "total_s": _round(total),
                "finish_reason": reasons[0] if len(reasons) == 1 else reasons, "preemptions": out.num_preemptions}))

    def render(self, stats: dict) -> bytes:
        """The Prometheus text exposition, with the gauges set from the latest engine stats."""
        self.running.set(stats["num_running"])
        self.waiting.set(stats["num_waiting"])
        self.blocks_total.set(stats["num_total_blocks"])
        self.blocks_free.set(stats["num_free_blocks"])
        self.hit_rate.set(stats["prefix_cache_hit_rate"])
        return generate_latest(self.registry)


def _round(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 6)
