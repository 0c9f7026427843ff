"""The engine's contracts: what it asks of an algorithm, of an algorithm's server-side aggregator, and what a client
sends. An algorithm subclasses `Algorithm` and says only what is specific to it; everything else (sampling,
batching, chunking, evaluation, logging) is the engine's. Importing this module does not import torch.
"""

from __future__ import annotations

import math
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from fedpilot.schema import Strict

if TYPE_CHECKING:
    import torch
    from torch import nn

    from fedpilot.engine.cohort import Cohort

    Tensors = dict[str, torch.Tensor]


@dataclass
class Upload:
    """What a cohort sends to the server; every tensor has a leading client dimension [K, ...].

    shared: the clients' new shared parameters (the aggregator turns them into deltas from the broadcast).
    grad:   or gradients of the shared parameters (PFLEGO, FFGG).
    mask:   optional 0/1 per entry for sparse uploads; the server then averages each entry over the
            clients that sent it (pFedGate's per-index aggregation).
    weight: aggregation weight of each client; the engine fills in the clients' train sample counts if None.
    """

    shared: Tensors | None = None
    grad: Tensors | None = None
    mask: Tensors | None = None
    weight: torch.Tensor | None = None


@dataclass(frozen=True)
class RoundInfo:
    """What the server knows of the round it aggregates: its seed key, cohort, broadcast and federation size."""

    key: tuple[int, int, int]  # (seed, stage index, round index): seeds every random draw of the round
    clients: torch.Tensor  # the ids of the whole cohort (every chunk, every process)
    broadcast: Tensors  # the shared parameters the cohort received
    n_clients: int  # clients in the federation

    @property
    def round(self) -> int:
        return self.key[2]


class Aggregator(ABC):
    """Server side of one round: `add` each chunk's upload, then `result` turns them into the pseudo-gradient of the
    server optimizer and the server's next state (the engine keeps and checkpoints that state)."""

    upload_bytes: int = 0  # bytes the clients sent this round

    @abstractmethod
    def add(self, upload: Upload, info: RoundInfo) -> None:
        """Take one chunk's upload (its weight filled in)."""

    @abstractmethod
    def result(self, info: RoundInfo, state: dict[str, Any]) -> tuple[Tensors, dict[str, Any]]:
        """(pseudo-gradient of the shared parameters, the server state after this round)."""


class ReducibleAggregator(Aggregator):
    """An aggregator whose state is sums: DDP processes that each aggregated a slice of the cohort combine by
    `all_reduce`, so one round can be split across devices."""

    @abstractmethod
    def all_reduce(self, info: RoundInfo, device: torch.device) -> None:
        """Sum this process's state with every other process's."""


class AlgorithmParams(Strict):
    """Hyperparameters of an algorithm: pydantic fields with their defaults (the one place defaults live); unknown
    keys and true/false for a number are refused."""


class StatefulParams(AlgorithmParams):
    """Hyperparameters of an algorithm with a stateless variant. stateful: false re-initialises a client's
    personal part at every participation from the stage's starting value, and keeps nothing (Pillutla et al., ICML
    2022, App. C.4)."""

    stateful: bool = True


@dataclass(frozen=True)
class Tunable:
    """A hyperparameter an algorithm declares tunable, with its default search range (a search's `space: auto`).

    The range is absolute, `low` to `high` (the built-in algorithms' ranges, from the literature); or relative,
    `around=f`: [v / f, v * f] around the value v the pipeline gives the key (or, where that is null, the value of the
    stage key `fallback`: a personal lr that defaults to `local.lr`); or `choices`. `log`: searched on a log scale.
    `integer`: a whole number. `budget`: it changes what a client spends (its local steps, its model's size), which a
    matched-budget comparison keeps as written. `source`: where the range comes from (authors, venue, section or
    table; "fedpilot: <why>" for what no paper gives), shown in docs/algorithms.md's table.
    `batchable`: trials that differ in it (and in other batchable values) can train as one batch (engine/trials.py),
    each row of the batch with its trial's value: a number used in arithmetic (a step size, a pull's weight). By
    default a range of floats that is not a `budget`; a whole number or a choice changes control flow or shapes
    (steps, epochs, widths) and is not, unless set.
    """

    low: float | None = None
    high: float | None = None
    around: float | None = None
    log: bool = True
    integer: bool = False
    choices: tuple[Any, ...] | None = None
    fallback: str | None = None
    budget: bool = False
    source: str | None = None
    batchable: bool | None = None  # None: as the kind of range says (above)

    def __post_init__(self) -> None:
        kinds = [self.low is not None or self.high is not None, self.around is not None, self.choices is not None]
        if sum(kinds) != 1:
            raise ValueError("give a range as `low` and `high`, as `around`, or as `choices`: exactly one")
        if kinds[0] and not (self.low is not None and self.high is not None and self.low < self.high):
            raise ValueError(f"needs low < high (low={self.low}, high={self.high})")
        if kinds[0] and self.log and self.low <= 0:
            raise ValueError(f"a log scale needs low > 0 (low={self.low})")
        if kinds[1] and not (math.isfinite(self.around) and self.around > 1):
            raise ValueError(f"`around` is a factor > 1 (around={self.around})")
        if kinds[2] and not self.choices:
            raise ValueError("`choices` needs at least one value")
        if self.source is not None and not (isinstance(self.source, str) and self.source.strip()):
            raise ValueError(f"`source` names where the range comes from, or is None (source={self.source!r})")
        if self.batchable is None:
            object.__setattr__(self, "batchable", not (self.budget or self.integer or kinds[2]))

    def dimension(self, value: Any) -> dict[str, Any]:
        """The search dimension (a search space's `Param` fields) for a stage whose key holds `value` (its
        fallback's where null): a relative range is centered on it, an absolute one widened to contain it."""
        if self.choices is not None:
            return {"type": "categorical", "choices": list(dict.fromkeys([*self.choices, *([value] if value is not
                                                                                       None else [])]))}
        low, high = (value / self.around, value * self.around) if self.around else (self.low, self.high)
        if self.around is None and isinstance(value, int | float) and not isinstance(value, bool):
            low, high = min(low, value), max(high, value)
        if self.integer:
            low, high = max(1, math.floor(low)), max(math.ceil(high), math.floor(low) + 1)
        return {"type": "int" if self.integer else "float", "low": low, "high": high,
                "log": self.log and low > 0}

    def describe(self) -> str:
        """The range in words, as docs/algorithms.md's table gives it: "0.001 to 100", "one of 0, 0.1", "the pipeline's
        value ÷/× 10"."""
        if self.choices is not None:
            return "one of " + ", ".join(f"{c:g}" if isinstance(c, float) else str(c) for c in self.choices)
        if self.around is not None:
            return f"the pipeline's value ÷/× {self.around:g}"
        return f"{self.low:g} to {self.high:g}"

    @property
    def scale(self) -> str:
        """How the range is searched: categorical, log or linear (integer where whole numbers)."""
        if self.choices is not None:
            return "categorical"
        return ("log" if self.log else "linear") + (", integer" if self.integer else "")


def step_size(fallback: str | None = None) -> Tunable:
    """A step size a decade either side of the pipeline's value (of `fallback`'s where null), on a log scale: a
    plugin's default where no paper gives a range. The built-in algorithms declare absolute ranges from the
    literature instead (`Tunable(low, high, source=...)`), so that a search is not centred on a hand-set value."""
    return Tunable(around=10, fallback=fallback, source="fedpilot: a decade either side of the pipeline's value, "
                   "no range from the literature")


# Stage keys the engine applies per trial in a batch whatever the algorithm: the local lr and weight decay row by row,
# the server optimizer's numbers (each trial its own parameter group). The optimizer's kind, budgets and the rest of
# a stage's settings are shared by a batch's trials.
BATCHABLE_KEYS = frozenset({"local.lr", "local.weight_decay", "server.lr", "server.momentum", "server.betas",
                            "server.eps"})

Part = Literal["personal", "shared"]
PERSONAL_AND_SHARED: frozenset[Part] = frozenset({"personal", "shared"})


class Algorithm(ABC):
    """What the engine asks of an algorithm. A subclass sets `name` and `Params` and implements `local_update`;
    the rest has defaults that fit most algorithms.

    Class attributes:
      visits_each_client_once  the stage is one pass over all clients (fine-tuning) instead of sampled rounds
      personal_copy            every parameter is both global (`cohort.shared`, aggregated) and personal (each
                               client's copy, `cohort.personal`); clients are evaluated with their copy (Ditto)
      needs                    what the algorithm needs of its stage's split: "personal" (at least one personal
                               parameter), "shared" (at least one shared parameter); `fedpilot validate` refuses a
                               stage whose split leaves a needed part empty (a property where it depends on Params)
      tunable                  its hyperparameters worth tuning and their default ranges, by stage key
                               (`local.lr`, `server.lr`, `params.<name>`): what a search's `space: auto` and
                               `fedpilot compare --tune` search
      constants                names of `client_state` entries that are per-client constants: each client's value
                               reaches `forward` in `params`, next to the parameters, in training and in evaluation;
                               local SGD never trains them (pFedGate's sparsity budget). Name them apart from the
                               model's parameters and buffers (the model's own forward ignores them)
      models_forward           set by the engine, not by a subclass: True where the class applies the model's own
                               forward to the parameters alone (no `forward` override, no constants), which lets
                               the executors run the model's layers their own way (engine/accel)
      batches_trials           trials of a search that differ only in batchable values (`batchable`) can train as
                               one batch (engine/trials.py): it reads every such value of its params and of the
                               `local` block through the cohort (`cohort.params`, `cohort.value`: one per row where
                               a chunk's trials differ) and reads no `server_state`. False (the default): its trials
                               run one at a time
    """

    name: ClassVar[str]
    Params: ClassVar[type[AlgorithmParams]] = AlgorithmParams
    visits_each_client_once: ClassVar[bool] = False
    personal_copy: ClassVar[bool] = False
    needs: ClassVar[frozenset[Part]] = frozenset()
    tunable: ClassVar[dict[str, Tunable]] = {}
    constants: ClassVar[frozenset[str]] = frozenset()
    models_forward: ClassVar[bool] = True
    batches_trials: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.models_forward = cls.forward is Algorithm.forward and not cls.constants

    def __init__(self, params: AlgorithmParams | dict[str, Any] | None = None):
        self.params = params if isinstance(params, self.Params) else self.Params.model_validate(params or {})

    @classmethod
    def batchable(cls, key: str) -> bool:
        """Whether trials that differ in the stage key `key` (`local.lr`, `server.lr`, `params.lr_v`, ...) can train
        as one batch: an algorithm that batches trials, and a key the engine applies per trial (BATCHABLE_KEYS) or a
        `params` key its `tunable` declares `batchable`."""
        return cls.batches_trials and cls.arithmetic(key)

    @classmethod
    def arithmetic(cls, key: str) -> bool:
        """Whether the stage key `key` only enters arithmetic (a value of it changes no control flow or shape): one
        the engine applies per trial (BATCHABLE_KEYS), or a `params` key its `tunable` declares `batchable`."""
        declared = cls.tunable.get(key) if key.startswith("params.") else None
        return key in BATCHABLE_KEYS or bool(declared is not None and declared.batchable)

    @property
    def p(self) -> AlgorithmParams:
        """Deprecated: the old name of `params` (the algorithm's hyperparameters), kept for one release."""
        warnings.warn(f"{type(self).__name__}.p is deprecated: use .params", DeprecationWarning, stacklevel=2)
        return self.params

    @property
    def stateful(self) -> bool:
        """Personal parameters persist across rounds in the engine's personal bank (else each visit restarts from
        the stage's starting value); StatefulParams' `stateful` sets it."""
        return self.params.stateful if isinstance(self.params, StatefulParams) else True

    @property
    def personal_part(self) -> str | list[str] | None:
        """A split preset or name regexes that override the pipeline's personalization ("none" for FedAvg, "all"
        for whole-model fine-tuning), or None to use the pipeline's."""
        return None

    def prepare_model(self, model: nn.Module, input_shape: tuple[int, ...]) -> None:  # noqa: B027 (optional hook)
        """Add what the algorithm needs to the model before the stage's split is applied (pFedGate's gate)."""

    def client_state(self) -> dict[str, torch.Tensor]:
        """Initial per-client state beyond parameters (e.g. Self-FL's variances), without the client dimension; the
        engine keeps a [n_clients, ...] bank of it, checkpointed, and hands a cohort its rows as `cohort.state`. A
        client that never took part keeps this value, also the `constants` among it (what its forward sees)."""
        return {}

    def server_state(self, n_clients: int) -> dict[str, Any]:
        """The server's state at the start of a stage (tensors and plain values); the aggregator's `result` returns
        the next one, `cohort.server_state` shows it to clients, the stage checkpoints it."""
        return {}

    def aggregator(self) -> Aggregator:
        """A fresh server-side aggregate for one round (default: the weighted mean of client updates)."""
        from fedpilot.engine.aggregate import WeightedMean

        return WeightedMean()

    def forward(self, model: nn.Module, params: Tensors, x: torch.Tensor) -> torch.Tensor:
        """How a client applies the model with `params` (its parameters, and its `constants`) to inputs `x`
        (default: the model's own forward); an algorithm that changes it (pFedGate's gated weights) overrides
        this."""
        from torch.func import functional_call

        return functional_call(model, params, (x,))

    @abstractmethod
    def local_update(self, cohort: Cohort) -> Upload:
        """Train the cohort locally (set `cohort.personal` to keep new personal parameters) and say what to send."""

    def adapt(self, cohort: Cohort) -> None:
        """How clients that never took part (novel clients) adapt before they are evaluated: set `cohort.personal`.
        Default: local SGD of the personal part from its starting value with the global model fixed, the cohort's
        local work being the pipeline's fine-tuning recipe; nothing without a personal part."""
        if cohort.personal:
            cohort.personal = cohort.sgd("personal").personal
