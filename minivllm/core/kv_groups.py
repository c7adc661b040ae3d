"""KVCacheGroups: which layers share a block table, when full-attention and sliding layers mix.

A block id names one page of the KV cache. When every layer attends alike, a page holds a block of
tokens for every layer, and one table per request says which pages hold its tokens. A hybrid model
(Gemma 3: five sliding layers for each global one) breaks that: a sliding layer stops reading a
block once its window has passed it, a global layer never does. So, as vLLM's hybrid KV-cache
manager does, the layers are cut into *groups* of equal size, each group of one kind; a page holds a
block of tokens for the layers of one group (layer i of a group uses page slot i), and each group
has its own table. A sliding group's pages go back to the pool as the window passes them, a full
group's stay. Pages of every group are the same size, so one pool serves them all.

A request's tables are kept interleaved in one list: logical block j of group g is entry
`j * num_groups + g`. With one group (every layer alike) that is the plain table.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class KVCacheGroups:
    layers: tuple[tuple[int, ...], ...]  # per group, its layers; the i-th uses page slot i
    windows: tuple[int | None, ...]  # per group, its layers' window (None: full attention)

    @property
    def num_groups(self) -> int:
        return len(self.layers)

    @property
    def group_size(self) -> int:
        """Layers per page: the first dimension of the cache tensor."""
        return max(len(group) for group in self.layers)

    @property
    def sliding(self) -> tuple[int, ...]:
        """The groups whose pages leave with the window."""
        return tuple(g for g, window in enumerate(self.windows) if window is not None)

    @cached_property
    def places(self) -> tuple[tuple[int, int], ...]:
        """Each layer's (group, page slot), in layer order."""
        where = {layer: (g, slot) for g, group in enumerate(self.layers)
                 for slot, layer in enumerate(group)}
        return tuple(where[layer] for layer in range(len(where)))


def kv_cache_groups(num_layers: int, sliding_window: int | None,
                    sliding_layers: tuple[bool, ...] | None = None) -> KVCacheGroups:
    """One group when every layer attends alike; else groups as large as the rarer kind's layer
    count, so the rarer kind (Gemma 3's global layers) fills one group and the other kind fills as
    many as it needs (the last one padded with unused slots when the counts do not divide)."""
    slides = (sliding_layers if sliding_layers is not None and sliding_window is not None
              else (sliding_window is not None,) * num_layers)
    kinds = {kind: [i for i in range(num_layers) if slides[i] == kind] for kind in (False, True)}
    if not kinds[False] or not kinds[True]:
        window = sliding_window if all(slides) else None
        return KVCacheGroups((tuple(range(num_layers)),), (window,))
    size = min(len(kinds[False]), len(kinds[True]))
    layers, windows = [], []
    for kind, members in kinds.items():
        for start in range(0, len(members), size):
            layers.append(tuple(members[start : start + size]))
            windows.append(sliding_window if kind else None)
    return KVCacheGroups(tuple(layers), tuple(windows))
