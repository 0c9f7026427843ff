"""What a comparison's MLflow run says of itself: its parameters (only those that apply, as used) and its
description (markdown on its Overview page: what ran, then the table as the command printed it)."""

from __future__ import annotations

from typing import Any

from fedpilot.compare.plan import Plan
from fedpilot.tracking import set_params


def comparison_params(plan: Plan) -> dict[str, Any]:
    """The set's settings as parameters: seeds, baseline, pipelines, overrides, shared stages and, tuned, the `tune:`
    block as used (its objective the one the studies optimize, its seeds the tuning seeds), without unset keys."""
    comparison, tune = plan.comparison, plan.comparison.tune
    params: dict[str, Any] = {"seeds": plan.seeds, "baseline": plan.baseline, "pipelines": list(plan.specs),
                              "overrides": comparison.overrides, "shared_stages": plan.shared}
    if tune is not None:
        used = {**tune.model_dump(mode="json"), "objective": _objective(plan), "seeds": comparison.tuning_seeds()}
        params |= set_params({"tune": used})  # tune.sampler.kind, ...: each setting its own column
    return params


def _objective(plan: Plan) -> str:
    spec = next(iter(plan.tuning.values()))
    return spec.search.objective[0].metric


def comparison_note(plan: Plan, table: str) -> str:
    """The comparison run's description: what ran (pipelines, seeds, baseline, tuning) and the table."""
    tune = plan.comparison.tune
    tuned = (f"each tuned first by an Optuna study of {tune.trials} trials on the validation `{_objective(plan)}` "
             f"of seed(s) {plan.comparison.tuning_seeds()}, which the comparison does not use; " if tune else "")
    pipelines = ", ".join(f"`{name}`" for name in plan.specs)
    return (f"**{plan.comparison.name}**: {len(plan.specs)} pipelines ({pipelines}), {tuned}each run on seeds "
            f"{plan.seeds} and compared with the baseline `{plan.baseline}` on the same seed. The report is the "
            "artifact `report.html`; each run's id is a tag `run.<pipeline>.<seed>`.\n\n```\n" + table + "\n```")
