"""The quickstart's FedAvg round (pipelines/quickstart.yaml's first stage: the MLP on digits over 100 clients) at
several cohort sizes: the stage's own `round_time_s` (the local work, aggregation and server step of a round) and the
process's CPU time over the round (every thread's; on a loaded machine the wall time mostly waits for a core), medians
of the rounds after the warm-up. The arithmetic of such a round is a fraction of a millisecond, so what grows with
the clients a round takes is the host's work per client.

    python bench/quickstart_round.py [--clients-per-round 5 50] [--rounds 42] [--warmup 2] [--execution auto]
                                     [--profile 20]

`--profile N` also prints cProfile's N functions with the most own time over the measured rounds of each size.
"""

from __future__ import annotations  # noqa: I001  (fedpilot first: see below)

import argparse
import cProfile
import logging
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import fedpilot  # noqa: F401  first, as in `fedpilot run`: its OpenMP wait policy is set before torch loads
import lightning as L

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
from arguments import COUNT, WARMUP, check_warmup  # noqa: E402

from fedpilot.engine.accel import AUTO, EXECUTORS  # noqa: E402
from fedpilot.engine.stage import FederatedStage  # noqa: E402
from fedpilot.models.split import apply_split  # noqa: E402
from fedpilot.pipeline.checks import prepare, stage_split  # noqa: E402
from fedpilot.spec import load_pipeline  # noqa: E402


class RoundTimes(L.Callback):
    """The stage's `round_time_s` and the process's CPU seconds of every round; cProfile over the rounds after
    `warmup` when `profiler` is given."""

    def __init__(self, warmup: int, profiler: cProfile.Profile | None):
        self.warmup, self.profiler, self.times, self.cpu = warmup, profiler, [], []
        self.began = 0.0

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if self.profiler is not None and batch_idx == self.warmup:
            self.profiler.enable()
        self.began = time.process_time()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.cpu.append(time.process_time() - self.began)
        self.times.append(module.round_log["round_time_s"])


def quickstart_stage(clients_per_round: int, rounds: int, execution: str, cache: Path) -> FederatedStage:
    """The quickstart's first stage (FedAvg) with `clients_per_round` clients a round, built as `fedpilot run` builds
    it, evaluated only after its last round."""
    overrides = [f"stages.0.clients_per_round={clients_per_round}", f"stages.0.rounds={rounds + 1}",
                 f"stages.0.execution={execution}", f"evaluation.every={rounds + 1}"]
    spec = load_pipeline(ROOT / "pipelines" / "quickstart.yaml", overrides)
    prepared = prepare(spec, cache)
    stage_spec, algorithm = spec.stages[0], prepared.algorithms[0]
    split_spec, dim = stage_split(spec, stage_spec, algorithm.personal_part)
    split = apply_split(prepared.model, split_spec, dim)
    return FederatedStage(prepared.model, split, prepared.tensors, algorithm, stage_spec.engine_config(spec.evaluation),
                          spec.seed, 0, task=prepared.task)


def measure(clients_per_round: int, args: argparse.Namespace,
            cache: Path) -> tuple[float, float, str, pstats.Stats | None]:
    """The median round time and CPU time at `clients_per_round`, the executor the stage ran, and the profile if
    asked for."""
    stage = quickstart_stage(clients_per_round, args.rounds, args.execution, cache)
    profiler = cProfile.Profile() if args.profile else None
    times = RoundTimes(args.warmup, profiler)
    trainer = L.Trainer(max_steps=args.rounds, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[times])
    trainer.fit(stage)
    if profiler is not None:
        profiler.disable()
    return (statistics.median(times.times[args.warmup:]), statistics.median(times.cpu[args.warmup:]), stage.execution,
            pstats.Stats(profiler) if profiler else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients-per-round", type=COUNT, nargs="+", default=[5, 50])
    parser.add_argument("--rounds", type=COUNT, default=42, help="rounds run, warm-up included")
    parser.add_argument("--warmup", type=WARMUP, default=2)
    parser.add_argument("--execution", default=AUTO, choices=[AUTO, *EXECUTORS])
    parser.add_argument("--profile", type=WARMUP, default=0, help="print the N functions with the most own time")
    args = parser.parse_args()
    check_warmup(parser, args)
    if max(args.clients_per_round) > 100:
        parser.error("argument --clients-per-round: the quickstart has 100 clients")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    rows = []
    with tempfile.TemporaryDirectory(prefix="fedpilot-quickstart-round-") as cache:
        for size in args.clients_per_round:
            median, cpu, executor, stats = measure(size, args, Path(cache))
            rows.append((size, median, cpu, executor))
            if stats is not None:
                print(f"\n## {size} clients a round: cProfile, own time\n")
                stats.sort_stats("tottime").print_stats(args.profile)
    print(f"\n| clients/round | round_time_s (median of {args.rounds - args.warmup}) | x the first | CPU time a round "
          "| x the first | executor |")
    print("|---:|---:|---:|---:|---:|---|")
    for size, median, cpu, executor in rows:
        print(f"| {size} | {1000 * median:.2f} ms | {median / rows[0][1]:.2f}x | {1000 * cpu:.2f} ms | "
              f"{cpu / rows[0][2]:.2f}x | {executor} |")


if __name__ == "__main__":
    main()
