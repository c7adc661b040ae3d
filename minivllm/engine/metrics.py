"""Prometheus metrics under vLLM's `vllm:` names (and `model_name` label), fed after each step.

vLLM's names, so dashboards written for vLLM work unchanged; minivllm adds the KV block counts,
which make a leaked block visible. The registry is the app's own, not prometheus_client's global
one, so two servers in one process keep separate counts. Nothing here touches the engine itself."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from minivllm.core.sequence import FinishReason
from minivllm.outputs import RequestOutput

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                    30.0, 60.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
FINISHED_REASONS = tuple(r.value for r in FinishReason)


# attribute -> (metric class, name, help text), in registration (scrape) order
_METRICS = {
    "running": (Gauge, "vllm:num_requests_running", "Sequences in the running batch."),
    "waiting": (Gauge, "vllm:num_requests_waiting", "Sequences waiting to be scheduled."),
    "kv_usage": (Gauge, "vllm:kv_cache_usage_perc", "KV-cache usage: 1 means every block is held."),
    "blocks_total": (Gauge, "minivllm:kv_blocks_total", "KV-cache blocks in the pool."),
    "blocks_free": (Gauge, "minivllm:kv_blocks_free", "KV-cache blocks no request holds (cached "
                    "ones included: they are evictable)."),
    "cache_queries": (Counter, "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                      "cache."),
    "cache_hits": (Counter, "vllm:prefix_cache_hits", "Prompt tokens the prefix cache served."),
    "ttft": (Histogram, "vllm:time_to_first_token_seconds", "Arrival to first output token."),
    "tpot": (Histogram, "vllm:time_per_output_token_seconds",
             "Mean time between output tokens after the first, per request."),
    "e2e": (Histogram, "vllm:e2e_request_latency_seconds", "Arrival to last output token."),
    "queue_time": (Histogram, "vllm:request_queue_time_seconds", "Arrival to first scheduled."),
    "req_prompt": (Histogram, "vllm:request_prompt_tokens", "Prompt tokens per finished request."),
    "req_generation": (Histogram, "vllm:request_generation_tokens",
                       "Output tokens per finished request."),
    "generation_tokens": (Counter, "vllm:generation_tokens", "Output tokens generated."),
    "prompt_tokens": (Counter, "vllm:prompt_tokens", "Prompt tokens of requests admitted."),
    "preemptions": (Counter, "vllm:num_preemptions", "Sequences preempted to free blocks."),
    # speculative decoding (vLLM's names): verification steps, drafts proposed, drafts accepted
    "spec_drafts": (Counter, "vllm:spec_decode_num_drafts", "Verification steps (one draft each)."),
    "spec_draft_tokens": (Counter, "vllm:spec_decode_num_draft_tokens", "Draft tokens proposed."),
    "spec_accepted": (Counter, "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted."),
}


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        r = self.registry = CollectorRegistry()
        for attr, (kind, name, doc) in _METRICS.items():
            extra = {"buckets": _TOKEN_BUCKETS if name.endswith("tokens") else _LATENCY_BUCKETS}
            setattr(self, attr, kind(name, doc, ["model_name"], registry=r,
                                     **(extra if kind is Histogram else {})).labels(model_name))
        self._spec_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Draft "
                                     "tokens accepted, by their position in the draft.",
                                     ["model_name", "position"], registry=r)
        self._model_name = model_name
        success = Counter("vllm:request_success", "Requests finished, by why they stopped.",
                          ["model_name", "finished_reason"], registry=r)
        self.finished = {reason: success.labels(model_name, reason) for reason in FINISHED_REASONS}
        self._first_token_seen: dict[str, bool] = {}  # request id -> TTFT already observed
        self._last: dict = {}

    def observe(self, outputs: list[RequestOutput], stats: dict) -> None:
        """Engine-loop listener: count tokens, time first tokens, and retire finished requests."""
        for key, counter in (("num_generated_tokens", self.generation_tokens),
                             ("num_preemptions", self.preemptions),
                             ("prefix_cache_queries", self.cache_queries),
                             ("prefix_cache_hits", self.cache_hits),
                             ("spec_num_steps", self.spec_drafts),
                             ("spec_num_proposed", self.spec_draft_tokens),
                             ("spec_num_accepted", self.spec_accepted)):
            delta = stats.get(key, 0) - self._last.get(key, 0)
            if delta > 0:
                counter.inc(delta)
        before = self._last.get("spec_num_accepted_per_pos", [])
        for pos, total in enumerate(stats.get("spec_num_accepted_per_pos", [])):
            delta = total - (before[pos] if pos < len(before) else 0)
            if delta > 0 or pos >= len(before):
                self._spec_per_pos.labels(self._model_name, str(pos)).inc(max(delta, 0))
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
        if m and m.first_token_time is not None and m.finished_time and num_out > 1:
            self.tpot.observe((m.finished_time - m.first_token_time) / (num_out - 1))
        if m and m.finished_time:
            self.e2e.observe(m.finished_time - m.arrival_time)
        if m and m.first_scheduled_time:
            self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
        self.req_prompt.observe(len(out.prompt_token_ids))
        self.req_generation.observe(sum(len(c.token_ids) for c in out.outputs))
        for c in out.outputs:
            self.finished[c.finish_reason if c.finish_reason in self.finished
                          else FinishReason.ABORT.value].inc()

    def render(self, stats: dict) -> bytes:
        """The Prometheus text exposition, with the gauges set from the latest engine stats."""
        self.set_gauges(stats)
        return generate_latest(self.registry)

    def set_gauges(self, stats: dict) -> None:
        """Gauges are read from the engine's stats when asked for (scrape, or LLM.get_metrics())."""
        self.running.set(stats["num_running"])
        self.waiting.set(stats["num_waiting"])
        total, free = stats["num_total_blocks"], stats["num_free_blocks"]
        self.blocks_total.set(total)
        self.blocks_free.set(free)
        self.kv_usage.set(1 - free / total if total else 0.0)
