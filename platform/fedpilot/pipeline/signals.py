"""Stopping a pipeline on SIGINT/SIGTERM: after the current round, with a checkpoint, its runs KILLED and resumable.
SIGUSR1 and SIGUSR2 do the same: they are what a Slurm job receives shortly before its time limit (`--signal`)."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Callback


class Stopped(SystemExit):
    """A pipeline stopped on SIGINT/SIGTERM after a round, with a checkpoint (exit code 128 + the signal)."""


log = logging.getLogger(__name__)  # what the user is told at once: the CLI shows fedpilot's log on stderr
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
_STOP: dict[str, int] = {}  # the signal that asked the running pipeline to stop, if any
_LISTENING = threading.Event()  # set while stop_on_signals' block runs


def _ask(signum: int, frame: Any) -> None:
    """The handler of the stop signals: remember the first, stop at once on a second Ctrl+C."""
    if _STOP and signum == signal.SIGINT:
        raise KeyboardInterrupt
    _STOP.setdefault("signal", signum)  # the first reason stays (a time-limit warning, then Slurm's SIGTERM)
    log.warning(f"\n{signal.Signals(signum).name}: stopping after this round with a checkpoint (Ctrl+C again: at "
                "once)")


def stop_asked() -> int | None:
    """The signal that asked to stop, if one did (a loop of several runs checks it between them)."""
    return _STOP.get("signal")


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """While the block runs, SIGINT, SIGTERM, SIGUSR1 and SIGUSR2 ask the training stage to stop after its current
    round (CheckpointOnStop); a second Ctrl+C stops at once. Outside the main thread, or inside another such block,
    nothing is installed (a stop asked between two runs of the outer block stops the next at its first round)."""
    if threading.current_thread() is not threading.main_thread() or _LISTENING.is_set():
        yield  # another thread's, or inside an outer block (a comparison's runs): the outer handlers stay
        return
    _STOP.clear()
    previous = {s: signal.signal(s, _ask) for s in STOP_SIGNALS}
    _LISTENING.set()
    try:
        yield
    finally:
        _LISTENING.clear()
        for s, handler in previous.items():
            signal.signal(s, handler)


class CheckpointOnStop(Callback):
    """After a round, if a stop was asked (stop_on_signals): save the checkpoint `path` and stop (runs KILLED). Under
    DDP every process stops after the same round, as soon as any of them was asked (rank 0 writes the checkpoint)."""

    def __init__(self, path: Path):
        self.path = path

    def on_train_start(self, trainer: L.Trainer, *args: Any) -> None:
        """The stop signals come here alone. Lightning installs a SIGTERM handler of its own as training starts
        (beside this one); its loop then raises SIGTERMException, a SystemExit with exit code 0 and no checkpoint,
        when the signal comes after this callback looked at the round but before the loop did."""
        if _LISTENING.is_set() and threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                signal.signal(s, _ask)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.strategy.reduce_boolean_decision(bool(_STOP), all=False):
            trainer.save_checkpoint(self.path)
            raise Stopped(128 + _STOP.get("signal", signal.SIGTERM))
