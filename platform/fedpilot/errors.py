"""Errors a user can fix, under one root (UserError): they name the bad key path, argument or variable, the bad value
and what is allowed. Its branches say where the fault is: a spec or an argument (SpecError), this machine's setup
(SetupError), a recorded run (RunError), a search (SearchError), a job or schedule (JobError), the data (DataError).
StageFailed is the other kind: a stage that cannot go on (exit code 1). Nothing here prints or exits: the CLI turns
each error into its one-line message and exit code."""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable
from types import UnionType
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

N = TypeVar("N", int, float)
MAX_SHOWN = 200  # characters of a bad value shown in an error (a whole 10,000-item list is no help)


class UserError(ValueError):
    """The root of the errors a user can fix: each names the key, argument or variable at fault (`key`), its value
    and the problem, with the allowed values where they are few; the CLI prints it in one line and exits with code 2.
    (A ValueError, so that one raised inside a pydantic validator reaches its caller as it is.)"""

    def __init__(self, key: str, value: Any, problem: str, allowed: Iterable[Any] | None = None):
        self.key, self.value, self.problem = key, value, problem
        self.allowed = list(allowed) if allowed is not None else None
        shown = repr(value)
        shown = shown if len(shown) <= MAX_SHOWN else f"{shown[:MAX_SHOWN - 3]}..."
        message = f"{key}={shown}: {problem}"
        if self.allowed:
            message += f" (allowed: {', '.join(map(str, self.allowed))})"
            hint = did_you_mean(value, self.allowed) or did_you_mean(key.rsplit(".", 1)[-1], self.allowed)
            if hint:
                message += f"; did you mean {hint!r}?"
        super().__init__(message)


class SpecError(UserError):
    """A bad value in a pipeline, a comparison set or a dataset spec, or in a command's argument."""


class SetupError(UserError):
    """This machine's setup: an environment variable, a path, a store or a service fedpilot cannot use."""


class RunError(UserError):
    """A recorded run a command names that it cannot use."""


class SearchError(UserError):
    """A search that cannot run as asked (no search block, several devices, a study with other directions)."""


class DataError(UserError):
    """Data that cannot be reached or read as its spec says."""


def within(key: str, value: N | None, low: N, high: N) -> N | None:
    """`value` (None passes) when low <= value <= high, else a SpecError on `key`."""
    if value is not None and not low <= value <= high:
        raise SpecError(key, value, f"must be from {low:,} to {high:,}")
    return value


class JobError(UserError):
    """A job or schedule a command names that cannot be found, changed or started."""


class NoSuchJob(JobError):
    """No job has this id."""

    def __init__(self, job_id: int):
        super().__init__("JOB_ID", job_id, "no such job")


class JobEnded(JobError):
    """The job ended already: there is nothing left to cancel."""

    def __init__(self, job_id: int, status: str):
        super().__init__("JOB_ID", job_id, f"the job already ended ({status})")


class CancelFailed(JobError):
    """The job's backend (Slurm's scancel) refused to cancel it."""


class SubmitRefused(JobError):
    """The job's backend cannot take the job: Slurm refused it, or its commands are not on this machine."""


class NoSuchSchedule(JobError):
    """No schedule has this name."""

    def __init__(self, name: str, known: list[str]):
        super().__init__("NAME", name, "no such schedule", allowed=known or None)


class ScheduleExists(JobError):
    """A schedule with this name exists already."""


class NoSuchRun(RunError):
    """The tracking store has no such MLflow run, or not one fedpilot can resume."""


class StoreUnavailable(SetupError):
    """A tracking store or database that cannot be opened."""


def check_finite(value: Any, key: str = "") -> None:
    """A SpecError naming the dotted key path (lists by index) of the first inf or nan anywhere in `value`."""
    if isinstance(value, float) and not math.isfinite(value):
        raise SpecError(key or "value", value, "not a finite number (inf and nan are not allowed)")
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list | tuple) else ()
    for part, item in items:
        check_finite(item, f"{key}.{part}" if key else str(part))


class StageFailed(Exception):
    """A stage that cannot go on: its training diverged, or its algorithm asked the engine to train nothing. Its runs
    are FAILED; the CLI prints this in one line and exits with code 1."""


class NothingToTrain(StageFailed):
    """An algorithm asked the engine to train (or take the gradient of) a part of the model that is empty in its
    stage's split; `fedpilot validate` refuses such a stage when the algorithm declares what it needs."""


class StageCrashed(StageFailed):
    """Code that raised while a stage was built or trained: a plugin's (an algorithm's `local_update`, a model's
    forward) or fedpilot's own (an internal failure). Named in one line: the stage, where its algorithm comes from,
    the round (None: outside the rounds), the exception's type and message and where it was raised (`at`);
    `traceback_at` is where its whole traceback was recorded (the stage run's error.txt), once it was. Unlike a
    stage that diverged, a crashed run can be resumed (once the code is fixed)."""

    def __init__(self, stage: str, origin: str, round_idx: int | None, error: BaseException, at: str | None):
        self.stage, self.origin, self.round, self.error, self.at = stage, origin, round_idx, error, at
        self.traceback_at: str | None = None
        when = f" in round {round_idx}" if round_idx is not None else ""
        message = str(error).strip().splitlines()[0] if str(error).strip() else ""
        super().__init__(f"stage {stage!r} ({origin}) failed{when}: {type(error).__name__}"
                         + (f": {message}" if message else "") + (f", at {at}" if at else ""))


# Where a traceback's frames are not the user's or fedpilot's code: the libraries fedpilot calls (and Python's own)
LIBRARIES = {"torch", "lightning", "lightning_fabric", "pytorch_lightning", "numpy", "optuna", "mlflow"}


def raised_at(error: BaseException) -> str | None:
    """Where `error` was raised, as `module:line in function()`: its traceback's innermost frame outside Python's
    standard library and the LIBRARIES (a plugin's line, or fedpilot's own); None when every frame is theirs."""
    import sys
    import traceback

    skipped, found = LIBRARIES | set(sys.stdlib_module_names), None
    for frame, line in traceback.walk_tb(error.__traceback__):
        name = frame.f_globals.get("__name__", "")
        if name.split(".")[0] not in skipped:
            found = f"{name}:{line} in {frame.f_code.co_name}()"
    return found


class Diverged(StageFailed):
    """A stage's training loss or aggregated update stopped being finite: resuming would diverge again."""

    def __init__(self, stage: str, round_idx: int, what: str, last_finite_loss: float | None):
        self.stage, self.round, self.what, self.last_finite_loss = stage, round_idx, what, last_finite_loss
        last = "none (the first round diverged)" if last_finite_loss is None else f"{last_finite_loss:.6g}"
        super().__init__(f"stage {stage!r} diverged at round {round_idx}: the {what} is not finite (last finite "
                         f"training loss: {last}); lower the learning rate (local.lr, server.lr or the algorithm's), "
                         "add local.clip_norm, or check the data")


class DataUnavailable(DataError):
    """The pipeline's data cannot be reached from here (a hub dataset while offline, not in the local cache): the
    checks that need the data cannot run here. `validate` and `submit` warn and go on (the worker or cluster may
    reach it); `run` stops with exit code 2 before creating anything."""


def check_memory(key: str, value: Any, nbytes: int, what: str) -> None:
    """A SpecError when building `what` needs more memory than this machine has: numpy would fail to allocate
    it, or the kernel stop the process."""
    import psutil

    total = psutil.virtual_memory().total
    if nbytes > total:
        raise SpecError(key, value, f"{what} would take about {nbytes / 2**30:.3g} GiB, more than this machine's "
                        f"{total / 2**30:.3g} GiB of memory")


def did_you_mean(value: Any, allowed: Iterable[Any]) -> str | None:
    """The closest allowed name to a misspelt one, if any is close."""
    if not isinstance(value, str):
        return None
    close = difflib.get_close_matches(value, [str(a) for a in allowed], n=1, cutoff=0.6)
    return close[0] if close else None


def from_validation(err: ValidationError, model: type[BaseModel], prefix: str = "") -> UserError:
    """pydantic's first error (an unknown key before the `missing` it causes) as a SpecError naming its key path.

    Unknown keys list the keys allowed there, unknown `kind`s the kinds, literals their values; a SpecError
    raised inside a validator passes through unchanged.
    """
    error = sorted(err.errors(), key=lambda e: e["type"] != "extra_forbidden")[0]
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, UserError):
        return cause
    owner, field_type, loc = _walk(model, error["loc"])
    key = ".".join([p for p in (prefix, *loc) if p != ""])
    value, kind = error.get("input"), error["type"]
    if kind in {"union_tag_invalid", "union_tag_not_found"}:
        tag = value.get("kind") if isinstance(value, dict) else None
        what = f"unknown {loc[-1]} kind" if loc else "unknown kind"
        return SpecError(f"{key}.kind", tag, what, allowed=list(_tags(field_type)))
    if kind == "extra_forbidden":
        return SpecError(key, value, "unknown key", allowed=list(owner.model_fields) if owner else None)
    if kind == "literal_error":
        return SpecError(key, value, "not an allowed value", allowed=get_args(_strip(field_type)))
    if kind == "missing":
        return SpecError(key, None, "required")
    if kind == "value_error" and cause is not None:  # a validator's own words, without pydantic's "Value error, "
        return SpecError(key, value, str(cause))
    return SpecError(key, value, error["msg"])


def _walk(model: type[BaseModel], loc: tuple[str | int, ...]) -> tuple[type[BaseModel] | None, Any, list[str]]:
    """(the model holding the last key of `loc`, that key's annotation, `loc` as strings without union tags)."""
    owner: type[BaseModel] | None = None
    current: Any = model
    path: list[str] = []
    for part in loc:
        current = _strip(current)
        tags = _tags(current)
        if isinstance(part, str) and part in tags:
            current = tags[part]
            continue
        member = _union_member(current, part)
        if member is not None:  # pydantic's label of the union member it tried (`dict[str,...]`): not a key
            current = member
            continue
        if isinstance(current, type) and issubclass(current, BaseModel):
            owner = current
            current = current.model_fields[part].annotation if part in current.model_fields else None
        elif get_origin(current) in (list, tuple, dict):
            current = get_args(current)[-1] if get_args(current) else None
        path.append(str(part))
    return owner, current, path


def _union_member(annotation: Any, label: str | int) -> Any:
    """The member of a plain union that pydantic's error location `label` names (`dict[str,...]`, a model's name),
    or None."""
    if get_origin(annotation) not in (Union, UnionType) or not isinstance(label, str):
        return None
    kind = label.split("[", 1)[0]
    return next((m for m in map(_strip, get_args(annotation))
                 if kind in (getattr(get_origin(m), "__name__", None), getattr(m, "__name__", None))), None)


def _strip(annotation: Any) -> Any:
    """An annotation without Annotated[...] and without `| None`."""
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if get_origin(annotation) in (Union, UnionType):
        members = [a for a in get_args(annotation) if a is not type(None)]
        if len(members) == 1:
            return _strip(members[0])
    return annotation


def _tags(annotation: Any) -> dict[str, type[BaseModel]]:
    """The `kind` tag -> model of a discriminated union of models (empty for anything else)."""
    if get_origin(annotation) not in (Union, UnionType):
        return {}
    members = [_strip(a) for a in get_args(annotation)]
    return {m.model_fields["kind"].default: m for m in members
            if isinstance(m, type) and issubclass(m, BaseModel) and "kind" in m.model_fields}
