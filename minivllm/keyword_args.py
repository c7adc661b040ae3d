"""Constructors that name what they refuse: an unknown keyword argument is a ValueError naming it.

Python's own is a TypeError that says nothing of what the class accepts, and vLLM code passes names
minivllm has no use for: `harmless` ones are accepted at values asking for nothing, then ignored."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

ANY = ("any value",)  # every value of this argument is harmless


def refuse_unknown_kwargs(cls: type, harmless: Mapping[str, tuple] | None = None) -> type:
    """Wrap `cls.__init__` (a dataclass's) so unknown keyword names are ValueErrors; returns cls."""
    init, known = cls.__init__, {f.name for f in fields(cls) if f.init}
    ignorable = {k: v for k, v in (harmless or {}).items() if k not in known}  # a real field wins

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        unknown = [k for k in kwargs if k not in known and k not in ignorable]
        if unknown:
            raise ValueError(f"{cls.__name__} got unknown or unsupported argument(s) "
                             f"{', '.join(map(repr, unknown))} (see the fields of "
                             f"{cls.__module__}.{cls.__name__})")
        for name in [k for k in kwargs if k in ignorable]:
            value, accepts = kwargs.pop(name), ignorable[name]
            if accepts is not ANY and not any(same_value(value, a) for a in accepts):
                raise ValueError(f"{cls.__name__}: {name}={value!r} is not supported by minivllm "
                                 f"(it accepts only {', '.join(map(repr, accepts))})")
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


def same_value(value: Any, accepted: Any) -> bool:
    """Equal and of the same kind (so True is not taken for 1); safe for unhashable values."""
    try:
        return bool(value == accepted) and isinstance(value, bool) == isinstance(accepted, bool)
    except Exception:  # an exotic __eq__ (arrays): not the harmless value
        return False
