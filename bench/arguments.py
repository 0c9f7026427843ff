"""What the benchmark scripts accept on their command lines: argparse types and checks that refuse a bad value with
argparse's one-line error and exit code 2 before any work, as the fedpilot CLI refuses its options (ranges,
choices, paths). Only the standard library at import: the contenders run in the peers' environments, without
fedpilot; a path is checked by fedpilot's own checks, imported when one is given."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path

MAX_SEED = 2**32 - 1  # numpy's and fedpilot's seeds have 32 bits


def number(kind: type[int] | type[float], low: float | None = None, high: float | None = None,
           above: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite `kind` of at least `low` (above it with `above`) and at most `high`."""
    bounds = ([f"{'>' if above else '>='} {low:g}"] if low is not None else []) + \
        ([f"<= {high:g}"] if high is not None else [])

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") \
                from None
        too_low = low is not None and (value <= low if above else value < low)
        if not math.isfinite(value) or too_low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{text!r}: must be {' and '.join(bounds) or 'finite'}")
        return value

    return parse


COUNT = number(int, 1)  # rounds, clients, repeats, sizes: at least one
WARMUP = number(int, 0)  # rounds before the measured ones, rows or functions shown: none or more
POSITIVE = number(float, 0, above=True)  # time limits, rates
SEED = number(int, 0, MAX_SEED)
FRACTION = number(float, 0, 1, above=True)  # a share of a true size


def device_name(text: str) -> str:
    """An argparse type: `cpu`, `cuda` or `cuda:N`, a CUDA device only where torch sees it."""
    kind, _, index = text.partition(":")
    if kind not in ("cpu", "cuda") or (index and (kind == "cpu" or not index.isdigit())):
        raise argparse.ArgumentTypeError(f"{text!r}: not a device (cpu, cuda, cuda:N)")
    if kind == "cuda":
        import torch

        count = torch.cuda.device_count()
        if int(index or 0) >= count:
            raise argparse.ArgumentTypeError(f"{text!r}: {count or 'no'} CUDA device{'' if count == 1 else 's'} "
                                             "visible here")
    return text


def input_file(text: str) -> Path:
    """An argparse type: a file that exists."""
    path = input_path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: a folder, not a file")
    return path


def input_path(text: str) -> Path:
    """An argparse type: a file or a folder that exists."""
    if not Path(text).exists():
        raise argparse.ArgumentTypeError(f"{text!r}: no such file or folder")
    return Path(text)


def output_file(text: str) -> Path:
    """An argparse type: a file the script writes, in a folder that exists (fedpilot's check of `--output`)."""
    from fedpilot.settings import check_output

    return _checked(text, lambda path: check_output("path", path))


def output_folder(text: str) -> Path:
    """An argparse type: a folder the script writes in, or creates (fedpilot's check of `--cache-dir`)."""
    from fedpilot.settings import check_folder

    return _checked(text, lambda path: check_folder("path", text, path))


def _checked(text: str, check: Callable[[Path], None]) -> Path:
    """`text` as a path that passed fedpilot's `check`, else argparse's error with the check's words."""
    from fedpilot.errors import UserError

    try:
        check(Path(text))
    except UserError as err:
        raise argparse.ArgumentTypeError(f"{text!r}: {err.problem}") from None
    return Path(text)


def check_warmup(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--warmup below --rounds: the figures are the median of the rounds after the warm-up."""
    if args.warmup >= args.rounds:
        parser.error(f"argument --warmup: {args.warmup} must be below --rounds ({args.rounds}): the figures are the "
                     "median of the rounds after the warm-up")
