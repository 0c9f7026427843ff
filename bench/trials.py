"""Trials trained together (issue 52): K trials of FedAvg and of FedAlt (a personal head) on the bench workloads
(bench/workload.py) that differ in their step sizes, one at a time (K stages, each alone, as a search runs its trials
today) against one batch of them (engine/trials.py), as trials per minute and the ratio, with peak memory; each row
also against the round's bound (bench/contenders/bound.py: one model over a round's samples in the largest batch that
fits), K trials' rounds costing at least K bound rounds.

    python bench/trials.py [--models cnn mlp] [--algorithms fedavg fedalt] [--trials 1 4 8 16] [--rounds 4]
                           [--repeats 2] [--execution auto] [--device cpu] [--json FILE]

A measurement is `rounds` rounds after a first one that is not counted (under `execution: auto` the executor's
timing, on the batch's own rows for a batch); one at a time, the first trial's stage chooses its executor and the
others go on with its choice (as their own timing would, at no cost to the figure). `--execution NAME` pins the
executor on both sides instead (on a loaded machine the timing's choice moves from turn to turn). The trials' lrs are
the workload's times 10 ** (-0.5 .. 0.5), one apart per trial (FedAlt: its personal and shared lrs, in opposite
orders). The measurements take turns, one at a time then batched, `repeats` times; each figure is the best of its
turns, and the range over the turns is printed. Peak memory: the process's resident set on a CPU (torch's
allocation on a GPU) while the batch trains, and while the trials train one at a time. `x bound`: a trial's batched
round against the round's bound; `ceiling`: one at a time against K bound rounds, what the batch would gain at the
bound. Beside the wall-clock figures, the process's CPU seconds (all its threads): on a machine shared with other
work the wall clock also counts the time the process waited for a core.
"""

from __future__ import annotations  # noqa: I001  (fedpilot first: its OpenMP wait policy is set before torch loads)

import argparse
import json
import os
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import fedpilot  # noqa: F401
import lightning as L
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent / "contenders"))
from arguments import COUNT, device_name, output_file  # noqa: E402
from bound import bound_times  # noqa: E402
from fedpilot_engine import federated_data, quiet_trainer  # noqa: E402
from machine import describe  # noqa: E402
from workload import WORKLOADS, Workload, build_model, write_data  # noqa: E402

from fedpilot.algorithms import build_algorithm  # noqa: E402
from fedpilot.engine.config import EXECUTORS, LocalConfig, StageConfig  # noqa: E402
from fedpilot.engine.data import ClientData  # noqa: E402
from fedpilot.engine.memory import PeakMemory, release_freed_memory  # noqa: E402
from fedpilot.engine.stage import FederatedStage  # noqa: E402
from fedpilot.engine.trials import TrialBatch  # noqa: E402
from fedpilot.models.split import ParamSplit  # noqa: E402
from fedpilot.models.zoo import build_model as zoo_model  # noqa: E402

HEAD = ["head.weight", "head.bias"]  # FedAlt's personal part


def trial_values(work: Workload, algorithm: str, trials: int) -> list[dict[str, Any]]:
    """The trials' values: lrs a decade wide around the workload's, one apart per trial."""
    factors = 10 ** np.linspace(-0.5, 0.5, trials) if trials > 1 else np.ones(1)
    if algorithm == "fedavg":
        return [{"local.lr": work.lr * f} for f in factors]
    return [{"params.lr_v": work.lr * f, "params.lr_u": work.lr * g} for f, g in zip(factors, factors[::-1],
                                                                                        strict=True)]


def trial_stage(work: Workload, algorithm: str, values: dict[str, Any], rounds: int, data: ClientData,
                execution: str) -> FederatedStage:
    """A stage of `rounds + 2` rounds (the first one not counted; the last, with the stage's final evaluation, not
    run) of the workload's model from its initial weights, with the trial's `values`."""
    model = zoo_model(work.model, work.input_shape, work.classes,
                      **({"hidden": work.width} if work.model == "cnn" else {"hidden": [work.width]}))
    model.load_state_dict(build_model(work).state_dict())
    local = LocalConfig(epochs=work.epochs, batch_size=work.batch_size, lr=values.get("local.lr", work.lr))
    config = StageConfig(rounds=rounds + 2, clients_per_round=work.clients_per_round, eval_every=rounds + 2,
                         local=local, execution=execution)
    params = {k.removeprefix("params."): v for k, v in values.items() if k.startswith("params.")}
    personal = HEAD if algorithm == "fedalt" else []
    return FederatedStage(model, ParamSplit.of(model, personal), data, build_algorithm(algorithm, params), config,
                          seed=work.seed)


class Counted(L.Callback):
    """The wall and CPU seconds (the process's, all its threads) of the rounds after the first."""

    def __init__(self) -> None:
        self.start: tuple[float, float] | None = None
        self.seconds = [0.0, 0.0]

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        now = (time.perf_counter(), time.process_time())
        if self.start is not None:
            self.seconds = [total + end - begin for total, end, begin in zip(self.seconds, now, self.start,
                                                                               strict=True)]
        self.start = now


def counted_seconds(module: L.LightningModule, rounds: int, device: str) -> list[float]:
    """[wall, CPU] seconds of `rounds` rounds of `module` after its first."""
    counted = Counted()
    quiet_trainer(rounds + 1, device, [counted]).fit(module)
    return counted.seconds


def one_at_a_time(work: Workload, algorithm: str, trials: int, rounds: int, data: ClientData,
                  device: str, execution: str) -> tuple[list[float], int, str]:
    """(counted [wall, CPU] seconds of the trials' stages run in turn, their peak memory, the first one's executor)."""
    seconds, choice = [0.0, 0.0], None
    release_freed_memory()
    with PeakMemory(torch_device(device)) as memory:
        for values in trial_values(work, algorithm, trials):
            stage = trial_stage(work, algorithm, values, rounds, data, execution)
            if choice is not None:
                stage.executor_choice.load_state_dict(choice)  # the first one's choice: no timing of its own
            seconds = [a + b for a, b in zip(seconds, counted_seconds(stage, rounds, device), strict=True)]
            choice = choice or stage.executor_choice.state_dict()
    return seconds, memory.bytes, choice["execution"]


def batched(work: Workload, algorithm: str, trials: int, rounds: int, data: ClientData,
            device: str, execution: str) -> tuple[list[float], int, str]:
    """(counted [wall, CPU] seconds of the trials as one batch, its peak memory, its executor)."""
    release_freed_memory()
    with PeakMemory(torch_device(device)) as memory:
        batch = TrialBatch([trial_stage(work, algorithm, v, rounds, data, execution)
                            for v in trial_values(work, algorithm, trials)])
        seconds = counted_seconds(batch, rounds, device)
    return seconds, memory.bytes, batch.execution


def torch_device(device: str) -> Any:
    import torch

    return torch.device(device)


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every (model, algorithm, trials) one at a time and batched, in turns, `repeats` times."""
    data = {}
    for model in args.models:
        write_data(WORKLOADS[model])
        data[model] = federated_data(WORKLOADS[model])
    turns: dict[tuple, dict[str, list]] = {}
    for turn in range(args.repeats):
        for model in args.models:
            work = WORKLOADS[model]
            for algorithm in args.algorithms:
                for trials in args.trials:
                    key = (model, algorithm, trials)
                    seen = turns.setdefault(key, {"alone": [], "batched": []})
                    run = (work, algorithm, trials, args.rounds, data[model], args.device, args.execution)
                    seen["alone"].append(one_at_a_time(*run))
                    seen["batched"].append(batched(*run))
                    (alone, alone_cpu), (together, together_cpu) = seen["alone"][-1][0], seen["batched"][-1][0]
                    print(f"turn {turn + 1}: {model} {algorithm} K={trials}: one at a time {alone:.3f} s "
                          f"({alone_cpu:.3f} CPU s), batched {together:.3f} s ({together_cpu:.3f} CPU s), load "
                          f"{os.getloadavg()[0]:.1f}", flush=True)
    return [row(key, seen) for key, seen in turns.items()]


def row(key: tuple, seen: dict[str, list]) -> dict[str, Any]:
    """The best of each side's turns (wall seconds; CPU seconds beside them) and the range of the turns' ratios."""
    model, algorithm, trials = key
    best = {side: [min(t[0][i] for t in seen[side]) for i in (0, 1)] for side in ("alone", "batched")}
    ratios = [[a[0][i] / b[0][i] for a, b in zip(seen["alone"], seen["batched"], strict=True)] for i in (0, 1)]
    return {"model": model, "algorithm": algorithm, "trials": trials, "one_at_a_time_s": best["alone"][0],
            "batched_s": best["batched"][0], "peak_bytes": max(t[1] for t in seen["batched"]),
            "one_at_a_time_cpu_s": best["alone"][1], "batched_cpu_s": best["batched"][1],
            "one_at_a_time_peak_bytes": max(t[1] for t in seen["alone"]),
            "ratio_range": [min(ratios[0]), max(ratios[0])], "cpu_ratio_range": [min(ratios[1]), max(ratios[1])],
            "executors": sorted({t[2] for t in seen["alone"]} | {t[2] for t in seen["batched"]})}


def bound_round_s(model: str, device: str) -> float:
    """The workload's round bound: the median of 3 rounds after one."""
    times = bound_times(WORKLOADS[model], 4, device)[0]
    return statistics.median(times[1:])


def print_table(rows: list[dict[str, Any]], rounds: int, bounds: dict[str, float]) -> None:
    print(f"\n## Trials trained together ({rounds} rounds a trial, best of the turns)\n")
    print("| model | algorithm | K | one at a time: trials/min | batched: trials/min | ratio (turns) | "
          "CPU-time ratio (turns) | batched x bound | ceiling | peak, batched (one at a time) | executors |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        k, alone, together = r["trials"], r["one_at_a_time_s"], r["batched_s"]
        bound = k * rounds * bounds[r["model"]]
        (low, high), (cpu_low, cpu_high) = r["ratio_range"], r["cpu_ratio_range"]
        print(f"| {r['model']} | {r['algorithm']} | {k} | {60 * k / alone:.1f} | {60 * k / together:.1f} | "
              f"{alone / together:.2f}x ({low:.2f}-{high:.2f}x) | "
              f"{r['one_at_a_time_cpu_s'] / r['batched_cpu_s']:.2f}x ({cpu_low:.2f}-{cpu_high:.2f}x) | "
              f"{together / bound:.2f}x | {alone / bound:.2f}x | "
              f"{r['peak_bytes'] / 2**30:.2f} ({r['one_at_a_time_peak_bytes'] / 2**30:.2f}) GiB | "
              f"{', '.join(r['executors'])} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn"], choices=sorted(WORKLOADS))
    parser.add_argument("--algorithms", nargs="+", default=["fedavg", "fedalt"], choices=["fedavg", "fedalt"])
    parser.add_argument("--trials", nargs="+", type=COUNT, default=[1, 4, 8, 16], help="K, trials in a batch")
    parser.add_argument("--rounds", type=COUNT, default=4, help="rounds counted a trial, after one not counted")
    parser.add_argument("--repeats", type=COUNT, default=2, help="turns of every measurement")
    parser.add_argument("--execution", default="auto", choices=["auto", *EXECUTORS],
                        help="the executor of every stage (auto: each stage's and batch's timed choice)")
    parser.add_argument("--device", type=device_name, default="cpu")
    parser.add_argument("--json", type=output_file, help="write the rows as JSON to this file")
    args = parser.parse_args()
    machine = {**describe(args.device), "date": datetime.now().isoformat(timespec="minutes")}
    print(f"{machine['date']}: {machine['cpu']}, {os.cpu_count()} cores, load average "
          f"{', '.join(f'{v:.2f}' for v in os.getloadavg())}", flush=True)
    rows = measure(args)
    bounds = {model: bound_round_s(model, args.device) for model in args.models}
    print_table(rows, args.rounds, bounds)
    print(f"\nload average at the end: {', '.join(f'{v:.2f}' for v in os.getloadavg())}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "machine": machine, "bound_round_s": bounds}, indent=1))


if __name__ == "__main__":
    main()
