"""vLLM's `vllm.v1.metrics.reader`: the registry `/metrics` serves (engine/metrics.py), read into
vLLM's `Counter`, `Gauge`, `Histogram` and `Vector` objects: what `LLM.get_metrics()` returns."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int  # only ever goes up


@dataclass
class Gauge(Metric):
    value: float  # up and down (running requests, KV-cache usage)


@dataclass
class Histogram(Metric):
    count: int  # = the "+Inf" bucket
    sum: float  # of every observation
    buckets: dict[str, int]  # upper bound ("0.1", ..., "+Inf") -> cumulative count at or below it


@dataclass
class Vector(Metric):
    values: list[int]  # counters by position (vLLM's one use: accepted drafts per position)


# vector metric -> its index label
VECTOR_LABEL = {"vllm:spec_decode_num_accepted_tokens_per_pos": "position"}


def read_metrics(registry: CollectorRegistry, prefix: str = "vllm:") -> list[Metric]:
    """Every metric in `registry` whose name starts with `prefix`, one object per label set."""
    out: list[Metric] = []
    for family in registry.collect():
        name = family.name
        if not name.startswith(prefix):
            continue
        samples = family.samples
        if family.type == "gauge":
            out += [Gauge(name, dict(s.labels), float(s.value)) for s in samples if s.name == name]
        elif family.type == "counter" and name in VECTOR_LABEL:
            out += _vectors(name, [s for s in samples if s.name == name + "_total"],
                            VECTOR_LABEL[name])
        elif family.type == "counter":
            out += [Counter(name, dict(s.labels), int(s.value)) for s in samples
                    if s.name == name + "_total"]
        elif family.type == "histogram":
            out += _histograms(name, samples)
    return out


def _key(labels: dict[str, str], drop: str | None = None) -> tuple:
    return tuple(sorted((k, v) for k, v in labels.items() if k != drop))


def _histograms(name: str, samples) -> list[Histogram]:
    by_labels: dict[tuple, Histogram] = {}
    for s in samples:
        key = _key(s.labels, "le")
        hist = by_labels.setdefault(key, Histogram(name, dict(key), 0, 0.0, {}))
        if s.name == name + "_bucket":
            hist.buckets[s.labels["le"]] = int(s.value)
        elif s.name == name + "_count":
            hist.count = int(s.value)
        elif s.name == name + "_sum":
            hist.sum = float(s.value)
    return list(by_labels.values())


def _vectors(name: str, samples, index_label: str) -> list[Vector]:
    by_labels: dict[tuple, dict[int, int]] = {}
    for s in samples:
        by_labels.setdefault(_key(s.labels, index_label),
                             {})[int(s.labels[index_label])] = (int(s.value))
    return [Vector(name, dict(key), [values.get(i, 0) for i in range(max(values) + 1)])
            for key, values in by_labels.items()]
