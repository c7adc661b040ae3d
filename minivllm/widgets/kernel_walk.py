"""The paged decode kernel's walk, as recorded from its own run: for every program instance
(request, kv head, split), the KV blocks each tile read through the block table and the
online-softmax running maximum after it.

The recording is `minivllm/kernels/program_log.py`'s (Triton's interpreter executes the kernel's
Python body, so the table loads and the max it computes are logged as they happen); this module only
reads that log and draws it, so a figure never shows a number the kernel did not produce.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from minivllm.kernels.program_log import ProgramLog

SPLIT_COLORS = ("#9ecae1", "#fdae6b", "#a1d99b", "#bcbddc", "#fc9272", "#d9d9d9")


class TileRead(NamedTuple):
    """One loop iteration of one program: the physical blocks behind its positions (in table order)
    and the running max m_i after it, one value per query head of the group (log2 units: the
    kernel folds log2(e) into the scores to use exp2)."""

    blocks: tuple[int, ...]
    running_max: tuple[float, ...]


Program = tuple[int, int, int]  # (request, kv head, split): the kernel's program ids


def decode_walk(log: ProgramLog, table: str = "block_tables") -> dict[Program, list[TileRead]]:
    """The decode kernel's walk from its logged launch: each load from the block table starts a tile
    (its kept entries, in order, are the blocks it reads); the last float maximum before the next
    tile is that tile's running max."""
    from minivllm.kernels.program_log import Load, Maximum

    walk: dict[Program, list[TileRead]] = {}
    for event in log.events:
        if isinstance(event, Load) and event.tensor == table and event.values is not None:
            blocks = tuple(dict.fromkeys(event.values[event.mask].tolist()))
            walk.setdefault(event.program, []).append(TileRead(blocks, ()))
        elif isinstance(event, Maximum) and event.program in walk:
            tile = walk[event.program][-1]
            walk[event.program][-1] = tile._replace(running_max=tuple(event.values.tolist()))
    return walk


def kernel_walk_figure(walk: Mapping[Program, Sequence[TileRead]], kv_head: int = 0,
                       group: int | None = None) -> Figure:
    """One panel per request: its context's tiles coloured by the split (program) that read them and
    labelled with the physical blocks read, and each query head's running max tile after tile
    (restarting in every split: the reduce kernel merges the slices afterwards)."""
    from matplotlib.figure import Figure

    requests = sorted({b for b, h, _ in walk if h == kv_head})
    fig = Figure(figsize=(9, 1.9 * len(requests) + 0.4), layout="constrained")
    axes = fig.subplots(len(requests), 1, squeeze=False)[:, 0]
    for ax, b in zip(axes, requests):
        splits = sorted(s for r, h, s in walk if r == b and h == kv_head)
        tile = 0
        for s in splits:
            tiles = walk[(b, kv_head, s)]
            heads = len(tiles[0].running_max) if tiles else 0
            for h in range(min(heads, group or heads)):
                xs = [tile + i + 0.5 for i in range(len(tiles))]
                ax.plot(xs, [t.running_max[h] for t in tiles], marker="o", ms=3, lw=1,
                        color=f"C{h}", label=f"query head {h}" if s == splits[0] else None)
            for i, t in enumerate(tiles):
                ax.axvspan(tile + i, tile + i + 1, color=SPLIT_COLORS[s % len(SPLIT_COLORS)],
                           alpha=0.5, ec="white", lw=2)
                ax.text(tile + i + 0.5, 1.02, "blocks " + ",".join(map(str, t.blocks)),
                        transform=ax.get_xaxis_transform(), ha="center", fontsize=7)
            if tiles:
                ax.text(tile + 0.05, 0.04, f"split {s}", transform=ax.get_xaxis_transform(),
                        fontsize=7)
            tile += len(tiles)
        ax.set_xlim(0, max(tile, 1))
        ax.set_ylabel(f"request {b}\nm_i", fontsize=8)
        ax.set_xticks(range(tile + 1))
        ax.tick_params(labelsize=7)
    axes[-1].set_xlabel("tile of the context (BLOCK_N positions each)")
    axes[0].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(f"the decode kernel's programs for kv head {kv_head}: blocks read and running max",
                 fontsize=9)
    return fig
