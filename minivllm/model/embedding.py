"""The token embedding, split by vocabulary rows across tensor-parallel ranks (Megatron's way).

Rank r holds rows [r * V', (r + 1) * V') with V' = ceil(vocab / N) (the last rank's tail is zero
padding). A token outside a rank's rows looks up zeros there; one all-reduce adds the ranks' rows,
so every rank ends with the full hidden state. The LM head, tied to this weight or not, is split the
same way (its logits gathered). A tied head whose kernel held the weight in a faster layout lends
the embedding that layout and a `lookup` of rows in it (`read_rows_from`): the weight is held once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.core.math_utils import cdiv
from minivllm.distributed.parallel import SINGLE, TensorParallel, shard_of


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        self.rows = cdiv(vocab_size, tp.size)  # per rank
        self.start = tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size), requires_grad=False)
        self.lookup: Callable[[torch.Tensor], torch.Tensor] | None = None  # see read_rows_from

    def read_rows_from(self, weight: nn.Parameter,
                       lookup: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Hold `weight` (a tied LM head's, in its kernel's layout) instead of the plain table, and
        find each token's row with `lookup`."""
        self.weight, self.lookup = weight, lookup

    def table(self) -> torch.Tensor:
        """This rank's [rows, hidden] table as plain rows, whichever layout holds it (to read)."""
        return self._rows(torch.arange(self.rows, device=self.weight.device))

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight) if self.lookup is None else self.lookup(ids)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._rows(input_ids)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        x = self._rows(local.masked_fill(outside, 0))
        return self.tp.all_reduce(x.masked_fill_(outside[:, None], 0))

    def weight_loader(self, loaded: torch.Tensor, where: str = "") -> None:
        """Copy this rank's rows of the checkpoint's [vocab, hidden] tensor."""
        if loaded.shape != (self.vocab_size, self.weight.shape[1]):
            raise ValueError(f"{where} has shape {tuple(loaded.shape)}, expected "
                             f"({self.vocab_size}, {self.weight.shape[1]})")
        with torch.no_grad():
            self.weight.copy_(shard_of(loaded, 0, self.tp.rank, self.rows))
