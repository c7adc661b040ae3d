"""vLLM's `vllm.v1.metrics.reader`: the metric classes live in minivllm/engine/metrics_reader.py."""

from minivllm.engine.metrics_reader import Counter, Gauge, Histogram, Metric, Vector

__all__ = ["Counter", "Gauge", "Histogram", "Metric", "Vector"]
