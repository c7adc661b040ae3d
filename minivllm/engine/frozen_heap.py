"""Keep CPython's full garbage collections off the objects that live as long as the engine.

The collector finds reference cycles by walking every container in a generation. Beside the
embedded model the oldest one holds ~390,000 objects loaded at start (torch, transformers, the
model's modules, the tokenizer), none of them garbage. A batch of 64 requests promotes tens of
thousands of objects of its own, so CPython walks all of them about once a batch, in the middle of
a step: 0.16 s on a 2-core CPU, as long as 30 of its steps (`bench/RESULTS.md`, session 24).

`gc.freeze()` moves every tracked object into a permanent generation that collections skip, and
`gc.unfreeze()` moves them back into the oldest one. So `LLM.generate` freezes what is alive when
its steps begin and gives it back when they end: collections during the steps walk only what the
steps made, and garbage that was frozen is found by the first full collection after. The server
freezes once, after start-up, for the life of the process, as vLLM does (server/app.py).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Freeze what is alive now for the length of the block, unless something froze it already (the
    server, or the caller: theirs to give back, so it is left as it is)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
