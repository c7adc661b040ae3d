"""One rank's view of tensor parallelism: who it is, and the three collectives the model needs.

A `TensorParallel` is passed explicitly to every layer that splits (model/linear.py,
model/embedding.py). Its process groups are built directly on a c10d store (TCPStore), not through
`init_process_group`, so two engines in one process (or a user's own default group) never meet:
`device_group` for the model's tensors (gloo on CPU, NCCL on CUDA) and `cpu_group` (always gloo) for
the engine's own messages (the step's SchedulerOutput, the KV block count). Each rank counts what
its collectives carried (`traffic`), which chapter 13 checks against the bytes per token it derives.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F


@dataclass
class CollectiveTraffic:
    """What one rank's model handed to its collectives: calls, and the bytes of the tensors given
    (each rank's input; on the wire a ring all-reduce sends 2 (N - 1) / N of that per rank, an
    all-gather (N - 1) times)."""

    all_reduce_calls: int = 0
    all_reduce_bytes: int = 0
    all_gather_calls: int = 0
    all_gather_bytes: int = 0

    def reset(self) -> None:
        self.__dict__.update(CollectiveTraffic().__dict__)


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    device_group: object = None  # a ProcessGroup (None when size == 1)
    cpu_group: object = None
    traffic: CollectiveTraffic = field(default_factory=CollectiveTraffic, compare=False)  # size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks in place (row-parallel layers' partial sums, vocab-parallel embedding)."""
        if self.size > 1:
            self.traffic.all_reduce_calls += 1
            self.traffic.all_reduce_bytes += x.numel() * x.element_size()
            self.device_group.allreduce([x]).wait()
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """Element-wise max over ranks in place (at load: row-parallel int8 scales; not counted)."""
        if self.size > 1:
            _all_reduce(self.device_group, x, dist.ReduceOp.MAX)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` side by side along the last dim (the LM head's vocab shards)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        self.traffic.all_gather_calls += 1
        self.traffic.all_gather_bytes += x.numel() * x.element_size()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.device_group.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def min_int(self, value: int) -> int:
        """The smallest `value` over ranks (the KV block count: all must allocate the same ids)."""
        if self.size == 1:
            return value
        return int(_all_reduce(self.cpu_group, torch.tensor([value]), dist.ReduceOp.MIN).item())

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0's `obj` on every rank: its pickle's length, then its bytes, on the gloo group."""
        if self.rank == 0:
            data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)),
                                    dtype=torch.uint8)
            size = torch.tensor([len(data)], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        self.cpu_group.broadcast(size, 0).wait()
        if self.rank != 0:
            data = torch.empty(int(size.item()), dtype=torch.uint8)
        self.cpu_group.broadcast(data, 0).wait()
        obj = obj if self.rank == 0 else pickle.loads(data.numpy().tobytes())
        if obj is None:  # the end of the workers' loop: the processes may exit right after
            _settle(size, data)
        return obj


def _settle(*tensors: torch.Tensor, timeout_s: float = 1.0) -> None:
    """Wait (at most `timeout_s`) until gloo's threads have let go of `tensors`. A gloo thread drops
    a finished collective's tensors just after wait() returns, and that takes the GIL: if the
    interpreter is exiting by then, the thread is ended inside C++ and the process aborts
    (std::terminate; a torchrun rank 0 died so at exit in about one run of seven)."""
    deadline = time.monotonic() + timeout_s  # (a torch without Tensor._use_count: no wait)
    while (any(getattr(t, "_use_count", lambda: 1)() > 1 for t in tensors)
           and time.monotonic() < deadline):
        time.sleep(0.001)


def _all_reduce(group, x: torch.Tensor, op) -> torch.Tensor:
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    group.allreduce([x], opts).wait()
    return x


SINGLE = TensorParallel()  # one process: every collective is the identity


def connect(rank: int, size: int, store: dist.Store, device: torch.device,
            timeout_s: float) -> TensorParallel:
    """Join the two process groups on `store` (every rank calls this; gloo connects all pairs)."""
    timeout = timedelta(seconds=timeout_s)
    cpu_group = dist.ProcessGroupGloo(dist.PrefixStore("cpu", store), rank, size, timeout)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        device_group = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, size, options)
    else:
        device_group = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, timeout)
    return TensorParallel(rank, size, device_group, cpu_group)


def kv_head_replicas(num_kv_heads: int, tp_size: int) -> int:
    """How many ranks hold each KV head: 1, or tp / kv_heads when fewer KV heads than ranks."""
    return max(1, tp_size // num_kv_heads)


def local_kv_heads(num_kv_heads: int, tp_size: int) -> int:
    """KV heads one rank computes and caches."""
    return num_kv_heads * kv_head_replicas(num_kv_heads, tp_size) // tp_size


def check_divisible(model_config, tp_size: int) -> None:
    """A ValueError at start-up, naming tensor_parallel_size and the count, for a model that does
    not split."""
    mc = model_config
    layers = mc.moe_layers or [bool(mc.num_experts)] * mc.num_layers
    counts = [("num_attention_heads", mc.num_heads)]
    if not all(layers):  # some layer has a dense MLP
        counts.append(("intermediate_size", mc.intermediate_size))
    if any(layers) and not mc.expert_parallel:  # every expert is split (vLLM's default)
        counts.append(("experts' intermediate size", mc.moe_intermediate_size))
    if any(layers) and mc.shared_expert_intermediate_size:
        counts.append(("shared_expert_intermediate_size", mc.shared_expert_intermediate_size))
    if any(layers) and mc.expert_parallel and mc.num_experts < tp_size:
        raise ValueError(f"enable_expert_parallel with tensor_parallel_size={tp_size}: the model "
                         f"has only {mc.num_experts} experts per layer, fewer than the ranks")
    for name, count in counts:
        if count % tp_size:
            raise ValueError(f"tensor_parallel_size={tp_size} does not divide the model's {name} "
                             f"({count})")
    kv = mc.num_kv_heads
    if kv % tp_size and tp_size % kv:
        raise ValueError(f"tensor_parallel_size={tp_size} and the model's num_key_value_heads "
                         f"({kv}): one must be a multiple of the other (KV heads are split, or "
                         f"replicated when fewer than the ranks)")


def shard_of(loaded: torch.Tensor, dim: int, index: int, extent: int) -> torch.Tensor:
    """The `index`-th slice of `extent` along `dim`; zero-padded where it runs past the end (the
    vocab's last shard when the vocab size is not a multiple of the ranks)."""
    start = index * extent
    have = max(0, min(extent, loaded.shape[dim] - start))
    part = loaded.narrow(dim, min(start, loaded.shape[dim]), have)
    pad = [0, 0] * (loaded.dim() - 1 - dim) + [0, extent - have]  # F.pad lists the last dim first
    return part if have == extent else F.pad(part, pad)
