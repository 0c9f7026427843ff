"""Local fine-tuning (step (c) of Pillutla et al.'s pipeline, ICML 2022), Ditto-as-fine-tuning, and Local-only
training."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from fedpilot.api import Algorithm, AlgorithmParams, Tunable, Upload

if TYPE_CHECKING:
    from fedpilot.api import Cohort


class FinetuneParams(AlgorithmParams):
    """part: `personal` fine-tunes the personal parameters with the shared ones fixed (FT (part.));
    `all` fine-tunes a whole personal copy of the model (Finetune).
    prox: lambda of an L2 pull lambda/2 * ||w_i - w_start||^2 to the client's starting model; with
    part=all this is Pillutla et al.'s (ICML 2022) Ditto-as-fine-tuning (App. B.2, baseline (ii)).
    Local work (epochs, batch size, lr) is the stage's `local` block.
    """

    part: Literal["personal", "all"] = "personal"
    prox: float = Field(0.0, ge=0)


class Finetune(Algorithm):
    """Each client, visited once, trains its personal part locally; nothing is sent to the server."""

    name = "finetune"
    Params = FinetuneParams
    tunable = {"local.lr": Tunable(1e-4, 10.0, source=(
                   "Pillutla et al., ICML 2022, Table 9: fine-tuning lr 1e-4 to 1e-1 (step c); Chen et al., ICML "
                   "2023, App. H: FedAvg-FT on the grid 0.005-0.5; fedpilot: up to 10 for clipped steps (Shakespeare's "
                   "0.5)")),
               "params.prox": Tunable(choices=(0.0, 1e-4, 1e-3, 1e-2, 1e-1, 1.0), source=(
                   "Pillutla et al., ICML 2022, App. B.3: Ditto's lambda on {1e-4, ..., 1} (Ditto-as-fine-tuning); "
                   "fedpilot: 0, plain fine-tuning"))}
    visits_each_client_once = True
    batches_trials = True

    @property
    def personal_part(self) -> str | None:
        return "all" if self.params.part == "all" else None

    @property
    def needs(self) -> frozenset[str]:  # type: ignore[override]
        """part: personal fine-tunes the personal parameters, so the split must have some."""
        return frozenset({"personal"}) if self.params.part == "personal" else frozenset()

    def local_update(self, cohort: Cohort) -> Upload:
        start = dict(cohort.personal)
        cohort.personal = cohort.sgd("personal", prox=cohort.params.prox, reference=start).personal
        return Upload()


class LocalOnlyParams(FinetuneParams):
    """Local-only training: the whole model, personal to each client, trained on its own data alone."""

    part: Literal["personal", "all"] = "all"


class LocalOnly(Finetune):
    """Local-only baseline: every client trains its own copy of the stage's starting model, no communication."""

    name = "local"
    Params = LocalOnlyParams
