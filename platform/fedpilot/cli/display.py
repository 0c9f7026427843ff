"""What a long command shows while it works. `step` says what happens before the first line (checking, loading
torch, building the federation). A comparison's display follows its work (compare.events): on a terminal a rich
progress display under the lines the work prints; into a file (`fedpilot compare ... > log.txt`) plain lines, no
carriage return, each trial and run followed by where the comparison stands and the time it has left."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TextIO

import typer

from fedpilot.compare.events import Event, RunDone, RunStarted, StudyStarted, TrialDone, UnitsDone


def on_terminal(stream: TextIO) -> bool:
    """Whether `stream` is a terminal (not a file or a pipe)."""
    return hasattr(stream, "isatty") and stream.isatty()


@contextmanager
def step(text: str) -> Iterator[None]:
    """Say what the command does while the block runs: a spinner on a terminal, else one line (stderr)."""
    if on_terminal(sys.stderr):
        from rich.console import Console

        with Console(stderr=True).status(text):
            yield
        return
    typer.echo(f"{text} ...", err=True)
    yield


def duration(seconds: float) -> str:
    """3725 -> 'about 1 h 02 min'; 95 -> 'about 2 min'; under half a minute -> 'under a minute'."""
    minutes = round(seconds / 60)
    if minutes < 1:
        return "under a minute"
    return f"about {minutes} min" if minutes < 60 else f"about {minutes // 60} h {minutes % 60:02d} min"


def clock(seconds: float) -> str:
    """3725 -> '1:02:05'; 95 -> '1:35'."""
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}" if minutes >= 60 else f"{minutes}:{secs:02d}"


@dataclass
class Standing:
    """Where a comparison stands, from its events: its pipelines' studies (trials finished, best so far) and runs
    (done of total), what this process does now, and the time left at this process's pace so far. A trial trains
    on every tuning seed: it weighs as many runs."""

    pipelines: list[str]
    trials: dict[str, int]  # pipeline -> the trials its study is asked for (none without tuning)
    tuning_seeds: int
    objective: str
    maximize: bool
    started: float = field(default_factory=time.monotonic)
    finished: dict[str, int] = field(default_factory=dict)  # pipeline -> its study's finished trials
    best: dict[str, float] = field(default_factory=dict)
    runs_done: int = 0
    runs_total: int = 0
    done_here: float = 0.0  # run-weights this process finished
    now: str = "starting"

    def hear(self, event: Event) -> None:
        if isinstance(event, UnitsDone):
            self.runs_done, self.runs_total = event.done, event.total
            self.finished |= {p: max(self.trials[p], self.finished.get(p, 0)) for p in event.studied}
        elif isinstance(event, StudyStarted):
            self.finished[event.pipeline], self.trials[event.pipeline] = event.finished, event.trials
            if event.best is not None:
                self.best[event.pipeline] = event.best
            self.now = f"{self.position(event.pipeline)}: tuning, {self._next(event.pipeline)}"
        elif isinstance(event, TrialDone):
            self._trial(event)
        elif isinstance(event, RunStarted):
            self.now = f"{self.position(event.pipeline)}: run on seed {event.seed}" + (
                f" ({event.variant})" if self.trials else "")
        elif isinstance(event, RunDone):
            self.runs_done, self.done_here = min(self.runs_done + 1, self.runs_total), self.done_here + 1

    def _trial(self, event: TrialDone) -> None:
        finished = self.finished.get(event.pipeline, 0) + 1
        self.finished[event.pipeline] = finished
        self.done_here += self.tuning_seeds
        old = self.best.get(event.pipeline)
        if event.value is not None and (old is None or (event.value > old) == self.maximize):
            self.best[event.pipeline] = event.value
        self.now = f"{self.position(event.pipeline)}: tuning, {self._next(event.pipeline)}"

    def _next(self, pipeline: str) -> str:
        """The trial a study runs next, or what follows its N (trials beyond an edge of a range, then its runs)."""
        finished, asked = self.finished.get(pipeline, 0), self.trials.get(pipeline, 0)
        return f"trial {finished + 1} of {asked}" if finished < asked else "its trials done"

    def position(self, pipeline: str) -> str:
        return f"pipeline {self.pipelines.index(pipeline) + 1} of {len(self.pipelines)} ({pipeline})"

    def left(self) -> float:
        """Run-weights left: the studies' trials on every tuning seed, and the runs."""
        trials = sum(max(0, asked - self.finished.get(p, 0)) for p, asked in self.trials.items())
        return trials * self.tuning_seeds + max(0, self.runs_total - self.runs_done)

    def total(self) -> float:
        return sum(self.trials.values()) * self.tuning_seeds + self.runs_total

    def time_left(self) -> str:
        """At this process's pace so far; unknown before it finished anything."""
        if not self.done_here:
            return "time left: known after the first trial or run"
        pace = (time.monotonic() - self.started) / self.done_here
        return f"{duration(pace * self.left())} left"

    def study_line(self, pipeline: str) -> str:
        best = self.best.get(pipeline)
        shown = f", best {self.objective} {best:.4f}" if best is not None else ""
        finished = self.finished.get(pipeline, 0)
        return f"trial {finished} of {max(finished, self.trials.get(pipeline, 0))} done{shown}"

    def line(self, event: Event) -> str:
        """The plain line after a finished trial or run: the counters, the elapsed time, the time left."""
        what = (f"{self.position(event.pipeline)}: {self.study_line(event.pipeline)}" if isinstance(event, TrialDone)
                else f"{self.position(event.pipeline)}: run on seed {event.seed} done")
        elapsed = clock(time.monotonic() - self.started)
        return f"  [{what}; runs {self.runs_done} of {self.runs_total}; {elapsed} elapsed, {self.time_left()}]"


class PlainDisplay:
    """Lines for a file: what the work prints, and after each trial and run the standing's line."""

    def __init__(self, standing: Standing, write: Callable[[str], None] = typer.echo):
        self.standing, self.write = standing, write

    def echo(self, line: str) -> None:
        self.write(line)

    def event(self, event: Event) -> None:
        self.standing.hear(event)
        if isinstance(event, TrialDone | RunDone):
            self.write(self.standing.line(event))

    @contextmanager
    def shown(self) -> Iterator[None]:
        yield


class LiveDisplay(PlainDisplay):
    """On a terminal: rich's progress display (the comparison's share done, what runs now, the time left) under
    the lines the work prints."""

    def __init__(self, standing: Standing, title: str):
        from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

        super().__init__(standing)
        self.progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                                 TextColumn("{task.percentage:>3.0f}%"), TimeElapsedColumn(),
                                 TextColumn("{task.fields[left]}"))
        self.overall = self.progress.add_task(title, total=1, left="")
        self.current = self.progress.add_task("starting", total=None, left="")

    def echo(self, line: str) -> None:
        self.progress.console.print(line, markup=False, highlight=False)

    def event(self, event: Event) -> None:
        standing = self.standing
        standing.hear(event)
        total = standing.total() or 1
        self.progress.update(self.overall, total=total, completed=total - standing.left(),
                             left=standing.time_left())
        study = next((p for p in standing.pipelines if standing.now.startswith(standing.position(p))), None)
        detail = f" ({standing.study_line(study)})" if study and "tuning" in standing.now else ""
        self.progress.update(self.current, description=standing.now + detail)

    @contextmanager
    def shown(self) -> Iterator[None]:
        with self.progress:
            yield
