"""What the tests of searches and tuned comparisons share: the two-stage pipeline a tuned set compares, a pipeline
per built-in algorithm searched with `space: auto`, and in-memory studies to put a pruner to."""

from __future__ import annotations

from pathlib import Path

import optuna

from pipeline_fixtures import SMALL

ROOT = Path(__file__).resolve().parents[1]
# a short pretraining the set shares, then a stage of its own: fedavg (the baseline) or another algorithm
TUNED_BASE = {**SMALL, "dataset": {"partition": {"kind": "dirichlet", "alpha": 0.5, "clients": 12}},
              "tracking": {"system_metrics": False, "plots": False},
              "stages": [{**SMALL["stages"][0], "rounds": 2, "clients_per_round": 4},
                         {"name": "more", "algorithm": "fedavg", "rounds": 4, "clients_per_round": 4,
                          "local": {"steps": 2, "batch_size": 10, "lr": 0.05}}]}


def one_stage_after_pretraining(algorithm: str) -> dict:
    """The quickstart composed, its stage 1 running `algorithm` with its defaults, searched with `space: auto`."""
    from fedpilot.spec.compose import compose_pipeline

    raw = compose_pipeline(ROOT / "pipelines" / "quickstart.yaml", [])
    raw["stages"] = [raw["stages"][0], {"name": "tuned", "algorithm": algorithm, "rounds": 2,
                                        "local": {"lr": 0.04}}]
    raw["search"] = {"space": "auto", "stages": ["tuned"], "objective": "val_acc_mean"}
    return raw


def study_with(finished: list[dict[int, float]], noise: dict[str, list] | None = None) -> optuna.Study:
    """An in-memory study holding finished trials with these intermediate values (the last one its value); the
    first one's two seeds' evaluations `noise` (what trial 0's noise seed records)."""
    from optuna.distributions import FloatDistribution

    study = optuna.create_study(direction="maximize")
    for i, curve in enumerate(finished):
        study.add_trial(optuna.trial.create_trial(
            params={"x": 0.5}, distributions={"x": FloatDistribution(0, 1)}, value=curve[max(curve)],
            intermediate_values=curve, user_attrs={"curves": noise} if noise and i == 0 else {}))
    return study


def pruned_at(pruner: optuna.pruners.BasePruner, study: optuna.Study, curve: dict[int, float]) -> int | None:
    """The first step at which `pruner` prunes a trial reporting `curve` (None: it runs to the end)."""
    study.pruner = pruner
    trial = study.ask({"x": optuna.distributions.FloatDistribution(0, 1)})
    for step, value in sorted(curve.items()):
        trial.report(value, step)
        if trial.should_prune():
            return step
    return None
