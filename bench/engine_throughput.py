"""Seconds per round of the engine against the sequential executor, as ratios measured in one process.

Workloads (issue 3): FedAvg, batch 10, 1 local epoch, 20 train samples per client, on
  - the MLP (64-200-10) on digits-sized 8x8 inputs,
  - the 2-conv CNN on 28x28 single-channel inputs (62 classes),
at 10 / 50 / 200 clients per round; plus the head-only paths (FedAlt with a personal output layer:
trunk features once per round) and per-client evaluation of every client.

    python bench/engine_throughput.py [--rounds 5] [--clients 10 50 200] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import fedpilot.engine.sequential  # noqa: F401  registers the reference executor
from fedpilot.algorithms import build_algorithm
from fedpilot.data import FederatedData
from fedpilot.engine import FederatedStage, LocalConfig, StageConfig
from fedpilot.engine.local import choose_execution
from fedpilot.models import apply_split, build_model


def synthetic_clients(n_clients: int, per_client: int, shape: tuple[int, ...], classes: int,
                      device: torch.device) -> FederatedData:
    """n_clients x per_client train samples (plus 5 val/test each) of random inputs and labels."""
    per = per_client + 10
    gen = torch.Generator().manual_seed(0)
    x = torch.rand(n_clients * per, *shape, generator=gen)
    y = torch.randint(0, classes, (n_clients * per,), generator=gen)
    start = torch.arange(n_clients) * per
    full = torch.full((n_clients,), 1, dtype=torch.long)
    return FederatedData(x=x, y=y, offsets={"train": start, "val": start + per_client, "test": start + per_client + 5},
                         sizes={"train": full * per_client, "val": full * 5, "test": full * 5},
                         num_classes=classes, feature_shape=shape,
                         client_names=[str(i) for i in range(n_clients)], fingerprint="bench").to(device)


def seconds_per_round(model_name: str, data: FederatedData, clients: int, execution: str, algo: str = "fedavg",
                      personal: str = "none", rounds: int = 5, device: torch.device = torch.device("cpu")) -> float:
    """Median seconds of `rounds` rounds after one warm-up round."""
    torch.manual_seed(0)
    model = build_model(model_name, data.feature_shape, data.num_classes).to(device)
    split = apply_split(model, personal)
    cfg = StageConfig(rounds=rounds + 1, clients_per_round=clients, max_parallel_clients=clients,
                      local=LocalConfig(epochs=1, batch_size=10, lr=0.05))
    stage = FederatedStage(model, split.personal_names, data, build_algorithm(algo), cfg).to(device)
    stage.execution = execution
    stage.data = data
    optimizer = stage.configure_optimizers()
    stage.optimizers = lambda: optimizer  # drive rounds directly: the engine's cost without Trainer overhead
    times = []
    for r in range(rounds + 1):
        start = time.perf_counter()
        stage.run_round(r)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def evaluation_seconds(model_name: str, data: FederatedData, personal: str, execution: str) -> float:
    torch.manual_seed(0)
    model = build_model(model_name, data.feature_shape, data.num_classes)
    split = apply_split(model, personal)
    stage = FederatedStage(model, split.personal_names, data, build_algorithm("fedalt"), StageConfig())
    stage.execution = execution
    stage.log_dict = lambda *a, **k: None
    start = time.perf_counter()
    stage.evaluate(["test"], 0)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 50, 200])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}")
    workloads = {"mlp": ((1, 8, 8), 10), "cnn": ((1, 28, 28), 62)}
    print(f"\n{'model':5} {'clients':>7} {'sequential s':>13} {'vmap s':>9} {'loop s':>9} {'auto':>5} "
          f"{'auto x seq':>10}")
    for name, (shape, classes) in workloads.items():
        data = synthetic_clients(max(args.clients) * 2, 20, shape, classes, device)
        for k in args.clients:
            seq = seconds_per_round(name, data, k, "sequential", rounds=args.rounds, device=device)
            vm = seconds_per_round(name, data, k, "vmap", rounds=args.rounds, device=device)
            lp = seconds_per_round(name, data, k, "loop", rounds=args.rounds, device=device)
            auto = choose_execution("auto", build_model(name, shape, classes), device)
            best = {"vmap": vm, "loop": lp}[auto]
            print(f"{name:5} {k:7d} {seq:13.4f} {vm:9.4f} {lp:9.4f} {auto:>5} {seq / best:10.2f}")
    print("\nhead-only personalization (FedAlt, output layer personal), 50 clients per round:")
    for name, (shape, classes) in workloads.items():
        data = synthetic_clients(100, 20, shape, classes, device)
        auto = "auto"
        fast = seconds_per_round(name, data, 50, auto, "fedalt", "output_layer", args.rounds, device)
        slow = seconds_per_round(name, data, 50, "sequential", "fedalt", "output_layer", args.rounds, device)
        ev_fast = evaluation_seconds(name, data, "output_layer", auto)
        ev_slow = evaluation_seconds(name, data, "input_layer", auto)
        print(f"  {name}: round {fast:.4f} s vs sequential {slow:.4f} s ({slow / fast:.2f}x); "
              f"evaluation of 100 clients: trunk-once {ev_fast:.4f} s vs per-client model {ev_slow:.4f} s "
              f"({ev_slow / ev_fast:.2f}x)")


if __name__ == "__main__":
    main()
