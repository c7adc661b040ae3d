"""vLLM's `vllm.logger.init_logger`: a standard logger under "minivllm" (configured by the app)."""

from __future__ import annotations

import logging


def init_logger(name: str) -> logging.Logger:
    """A logger named `name`, placed under "minivllm." unless it already is (vLLM's own modules are
    named "vllm.*"; a user's "__main__" becomes "minivllm.__main__")."""
    return logging.getLogger(name if name == "minivllm" or name.startswith("minivllm.")
                             else f"minivllm.{name}")
