"""FlexibleArgumentParser: vLLM's argparse: `--max_model_len` works like `--max-model-len`, and an
unknown flag is an error naming it (not argparse's bare "unrecognized arguments")."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser that accepts underscores in flag names and names every unsupported flag."""

    def parse_known_args(self, args: Sequence[str] | None = None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args([_dashes(a) for a in args], namespace)

    def parse_args(self, args: Sequence[str] | None = None, namespace=None):
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            flags = [a for a in extra if a.startswith("-")]
            what = (f"unsupported argument(s): {' '.join(flags)}" if flags else
                    f"unexpected argument(s): {' '.join(extra)}")
            self.exit(2, f"{self.prog}: error: {what}. minivllm implements vLLM's flags for what "
                      f"its engine supports; see {self.prog} --help for the list\n")
        return parsed


def _dashes(arg: str) -> str:
    """'--max_model_len=8' -> '--max-model-len=8'; values and positionals are left alone."""
    if not arg.startswith("--"):
        return arg
    name, sep, value = arg.partition("=")
    return name.replace("_", "-") + sep + value
