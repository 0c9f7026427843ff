"""fedpilot's scaling on the shared workload (bench/workload.py): seconds per round against clients per round
(10 to 1000) and against model size, the evaluation of every client, and the fraction of the machine's
large-GEMM rate each achieves. bench/compare.py runs it after the side-by-side table.

    python bench/engine_throughput.py [--device cpu] [--rounds 4] [--warmup 1] [--gemm-gflops G]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "contenders"))
from arguments import COUNT, POSITIVE, WARMUP, check_warmup, device_name  # noqa: E402
from fedpilot_engine import round_times, stage_for  # noqa: E402
from machine import gemm_gflops  # noqa: E402
from workload import WORKLOADS, Workload, flops_per_round, median_after_warmup, write_data  # noqa: E402

CLIENTS_PER_ROUND = [10, 50, 200, 1000]
WIDTHS = {"cnn": [128, 512, 2048], "mlp": [200, 1000, 5000]}


def row(work: Workload, args, gemm: float) -> str:
    seconds = median_after_warmup(round_times(work, args.rounds, args.device), args.warmup)
    flops = flops_per_round(work)
    params = sum(p.numel() for p in stage_for(work, 1).model.parameters())
    return (f"| {work.model} | {work.width} | {params / 1e6:.2f}M | {work.clients_per_round} | {seconds:.4f} | "
            f"{work.clients_per_round / seconds:.0f} | {flops / seconds / 1e9:.3g} | "
            f"{100 * flops / seconds / 1e9 / gemm:.3g}% |")


def evaluation_seconds(work: Workload) -> tuple[float, float]:
    """One evaluation of all clients (20 samples each) by the stage's per-client evaluation, and the floor: the
    plain model's forward pass over the same samples in batches of 1000."""
    stage = stage_for(work, 1)
    stage.evaluate(["test"], 0)
    start = time.perf_counter()
    stage.evaluate(["test"], 0)
    engine = time.perf_counter() - start
    x = stage.data.x
    start = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(x), 1000):
            stage.model(x[i : i + 1000])
    return engine, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", type=device_name, default="cpu")
    parser.add_argument("--rounds", type=COUNT, default=4, help="rounds per measurement, warm-up included")
    parser.add_argument("--warmup", type=WARMUP, default=1)
    parser.add_argument("--models", nargs="+", default=["cnn", "mlp"], choices=sorted(WORKLOADS))
    parser.add_argument("--gemm-gflops", type=POSITIVE, help="the fp32 GEMM rate to compare with (default: measure)")
    args = parser.parse_args()
    check_warmup(parser, args)
    gemm = args.gemm_gflops or gemm_gflops(torch.float32, args.device)[0]
    print(f"\n## fedpilot scaling (FedAvg, auto executor, {args.device}, median of {args.rounds - args.warmup} rounds; "
          f"fp32 GEMM {gemm:.0f} GFLOP/s)\n")
    print("| model | width | params | clients/round | s/round | clients/s | GFLOP/s | of fp32 GEMM |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for model in args.models:
        base = WORKLOADS[model]
        write_data(base)
        for k in CLIENTS_PER_ROUND:
            print(row(dataclasses.replace(base, clients_per_round=k), args, gemm), flush=True)
        for width in WIDTHS[model]:
            if width != base.width:
                print(row(dataclasses.replace(base, width=width), args, gemm), flush=True)
    print("\n| model | evaluation of all 1000 clients (20 samples each), s | plain forward of the same samples, s |")
    print("|---|---:|---:|")
    for model in args.models:
        engine, plain = evaluation_seconds(WORKLOADS[model])
        print(f"| {model} | {engine:.4f} | {plain:.4f} |")


if __name__ == "__main__":
    main()
