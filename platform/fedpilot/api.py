"""fedpilot's public API for algorithms, models and dataset sources written outside the package (plugins, registered
by entry points: groups `fedpilot.algorithms`, `fedpilot.models`, `fedpilot.sources`) and for the built-in ones,
which use nothing else. Names here are stable; everything else in fedpilot is private (fedpilot.testing holds the
public test helpers).

- an algorithm: `Algorithm` (with its `Params`, an `AlgorithmParams` or `StatefulParams`, as `self.params`), which
  sees a `Cohort` (whose `sgd` returns a `Local`), returns an `Upload`, and may bring its own server side
  (`Aggregator`, `ReducibleAggregator` or `WeightedMean`, told the round by `RoundInfo`); it declares what is
  worth tuning in `tunable` (`Tunable` ranges by stage key with their `source`; `step_size()`, a decade around the
  pipeline's value, where no paper gives a range), which `space: auto` searches;
- the shapes a `Cohort` deals in: the engine hands an algorithm a round's cohort chunk by chunk. Everything per
  client is per client of the chunk, [K, ...] in the order of `cohort.clients` (`personal`, `constants`, `state`,
  `weights`, what `sgd` and `gradient` return, an `Upload`'s tensors), except a per-client `steps` tensor for `sgd`
  or `gradient`, which is per client of the whole cohort, [R] in the order of `cohort.cohort_clients` (the round's
  batch plan is drawn once for every chunk), and the federation's tensors ([n_clients], by client id: a server
  state's). `cohort.chunk_of(values)` takes the chunk's rows of a whole-cohort tensor; `cohort.per_client(values,
  like)` (and `per_client` for formula code) shapes a [K] tensor to broadcast against [K, ...] ones; a `steps`
  tensor or an argument of these two of the wrong length is an error that says which length is expected;
- trials trained together (engine/trials.py): a search's trials that differ only in numbers used in arithmetic can
  train as one batch, its chunks' rows belonging to several trials. An algorithm that reads its hyperparameters
  through the cohort, `cohort.params.<name>` and `cohort.value("local.lr")` (a number, or one per row [K] where the
  chunk's trials differ: `per_client` shapes either against [K, ...]), and reads no `server_state`, says so with
  `batches_trials = True`; its `tunable` declares which params may differ in a batch (`Tunable.batchable`: by default
  a float range that is not a budget). Read as one number from `self.params` inside a batch, a value that differs is
  an error naming where to read it. `cohort.shared` is then one global model per row (`cohort.broadcast` is [K, ...]
  always); an algorithm without the flag runs its trials one at a time;
- per-client constants (`Algorithm.constants`): buffers of the model (registered by the algorithm's
  `prepare_model`) each client holds its own value of, set through `cohort.constants`; the algorithm's `forward`
  sees a client's values in `params` in training and evaluation, no local step changes them, and a client that
  never took part has the buffer's value. `Algorithm.models_forward` says whether the model's own forward applies
  (no `forward` override, no constants);
- a model: built as `model(input_shape, num_classes, **options)`, like the built-in ones: a function that returns a
  `Net(body, head)`, or a `Net` subclass (its options: the keyword parameters after those two, typed by their
  annotations);
- a dataset source: a `Source` (pydantic fields = its options) whose `load` returns `RawData`;
- a task (not pluggable yet): `Task`, what the engine scores a model's outputs by (cohorts train with it);
- `SpecError(key, value, problem, allowed)`: a bad input, which the CLI prints as one line with exit code 2 (a
  `UserError`, the root of every error a user can fix);
- `Tensors`: `dict[str, torch.Tensor]`, tensors by parameter name (parameters, gradients, masks, client state).

Deprecated, kept for one release: `Params`, the old name of `Tensors` (it read like `Algorithm.Params`, the
hyperparameter class, which is a different thing; importing it warns), and `Algorithm.p`, the old name of
`Algorithm.params` (reading it warns).

Importing this module is cheap (no torch); the names that need torch or numpy load them on first use.
"""

import warnings
from importlib import import_module
from typing import TYPE_CHECKING, Any

from fedpilot.engine.protocol import (
    PERSONAL_AND_SHARED,
    Aggregator,
    Algorithm,
    AlgorithmParams,
    ReducibleAggregator,
    RoundInfo,
    StatefulParams,
    Tunable,
    Upload,
    step_size,
)
from fedpilot.errors import SpecError, UserError

_LAZY = {
    "Cohort": "fedpilot.engine.cohort",  # the clients of a round as one value; its sgd and gradient
    "Local": "fedpilot.engine.cohort",  # what Cohort.sgd returns: shared and personal parameters [K, ...]
    "WeightedMean": "fedpilot.engine.aggregate",  # the default aggregator, to subclass
    "LocalConfig": "fedpilot.engine.config",  # the stage's `local` block (cohort.local)
    "round_generator": "fedpilot.engine.batches",  # a torch.Generator seeded by (seed, stage, round, ...)
    "per_client": "fedpilot.engine.executor",  # a [K] tensor shaped to broadcast against [K, ...] ones
    "Net": "fedpilot.models.zoo",  # a model: head(body(x)); a plugin model returns one or subclasses it
    "Source": "fedpilot.data.config",  # a dataset source: options (pydantic fields) and `load`
    "RawData": "fedpilot.data.sources",  # what a source's `load` returns: features, targets, natural clients
    "Task": "fedpilot.engine.task",  # what outputs are scored by: loss, per-sample metrics
}

if TYPE_CHECKING:
    import torch

    Tensors = dict[str, torch.Tensor]
    Params = Tensors  # deprecated: the old name of Tensors

__all__ = ["PERSONAL_AND_SHARED", "Aggregator", "Algorithm", "AlgorithmParams", "Params", "ReducibleAggregator",
           "RoundInfo", "SpecError", "StatefulParams", "Tensors", "Tunable", "Upload", "UserError", "step_size",
           *_LAZY]


def __getattr__(name: str) -> Any:
    if name in ("Tensors", "Params"):  # a name for a type, not a module's: defined here, torch loaded on first use
        if name == "Params":
            warnings.warn("fedpilot.api.Params is deprecated: use fedpilot.api.Tensors (dict[str, torch.Tensor])",
                          DeprecationWarning, stacklevel=2)
        import torch

        return dict[str, torch.Tensor]
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_LAZY[name]), name)
