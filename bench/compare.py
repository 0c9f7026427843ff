"""fedpilot side by side with its peers on one workload, in one run: `make bench` (= python bench/compare.py).

Each contender runs the workload of bench/workload.py in its own process (the peers in their own virtual
environments, set up by bench/peers/setup.sh on first use) and reports its seconds per round; this driver samples the
memory of each contender's process tree (PSS, worker processes included), measures the machine's large-GEMM GFLOP/s,
and prints one markdown table per model with ratios to fedpilot, to the round's bound (bench/contenders/bound.py: one
model trained over the round's samples in the largest batch that fits, the same FLOPs) and the fraction of the GEMM
rate each contender achieves on the workload's FLOPs. The contenders run --repeats times, taking turns (fedpilot, the
plain loops, the peers, then again), so a change in the machine's load falls on all of them: the table gives the
median over the repeats and the range of each contender's ratio to fedpilot's time in the same turn. Then fedpilot's
scaling (bench/engine_throughput.py), its cost against the federation and cohort sizes (bench/scale.py) and the CNN's
first local step batched over the clients (bench/first_step.py). Not part of the test suite: nothing here asserts a
timing.

    python bench/compare.py [--models cnn mlp] [--rounds 7] [--warmup 2] [--repeats 3] [--device cpu|cuda]
                            [--peers flower pfl | --no-peers] [--no-scaling] [--no-scale] [--no-first-step]
                            [--clients-per-round 50 1000] [--clients N] [--contenders fedpilot plain-reuse ...]
                            [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from arguments import COUNT, POSITIVE, WARMUP, check_warmup, device_name, output_file
from machine import Watch, describe, gemm_gflops
from workload import WORKLOADS, flops_per_round, write_data

BENCH = Path(__file__).resolve().parent
VENVS = BENCH / ".venvs"

# key: (label, interpreter, script, extra arguments)
CONTENDERS = {
    "fedpilot": ("fedpilot (engine, auto)", sys.executable, "fedpilot_engine.py", []),
    "fedpilot-bf16": ("fedpilot (engine, bf16-mixed)", sys.executable, "fedpilot_engine.py",
                      ["--precision", "bf16-mixed"]),
    "fedpilot-sequential": ("fedpilot (sequential executor)", sys.executable, "fedpilot_engine.py",
                            ["--execution", "sequential"]),
    "plain-reuse": ("plain PyTorch loop, one model reused", sys.executable, "plain_torch.py",
                    ["--model-per-client", "reuse"]),
    "plain-fresh": ("plain PyTorch loop, new model per client", sys.executable, "plain_torch.py",
                    ["--model-per-client", "fresh"]),
    "bound": ("bound: one model, the round's samples in the largest batch", sys.executable, "bound.py", []),
    "bound-bf16": ("bound, bf16-mixed", sys.executable, "bound.py", ["--precision", "bf16-mixed"]),
    "pfl": ("pfl-research", str(VENVS / "pfl/bin/python"), "pfl_sim.py", []),
    "flower": ("Flower simulation (Ray)", str(VENVS / "flower/bin/python"), "flower_sim.py", []),
}


def bf16_supported(device: str) -> bool:
    """Whether the hardware has bf16 matmul units torch uses (CUDA bf16, or oneDNN's AVX-512-BF16/AMX path)."""
    if device.startswith("cuda"):
        return torch.cuda.is_bf16_supported()
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def run_contender(key: str, work, args) -> dict:
    label, python, script, extra = CONTENDERS[key]
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [python, "-W", "ignore", str(BENCH / "contenders" / script), "--workload", work.to_json(),
                   "--rounds", str(args.rounds), "--warmup", str(args.warmup), "--device", args.device,
                   "--out", out.name, *extra]
        start = time.perf_counter()
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        watch = Watch(process.pid, gpu=args.device.startswith("cuda"))
        try:
            log, _ = process.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            log, _ = process.communicate()
        measured = watch.stop()
        if process.returncode != 0:
            return {"key": key, "label": label, "error": (log or "").strip().splitlines()[-1:] or ["failed"]}
        result = json.loads(Path(out.name).read_text())
    return {"key": key, "label": label, "wall_s": time.perf_counter() - start, **result, **measured}


def ensure_peers(peers: list[str]) -> list[str]:
    """Set up the peers' environments on first use; the peers whose setup failed are left out with a note."""
    missing = [p for p in peers if not (VENVS / p / ".installed").exists()]
    if missing:
        print(f"setting up peer environments {missing} in {VENVS} (first use only) ...", file=sys.stderr)
        subprocess.run(["bash", str(BENCH / "peers/setup.sh"), *missing], check=False)
    ready = [p for p in peers if (VENVS / p / ".installed").exists()]
    for p in sorted(set(peers) - set(ready)):
        print(f"note: peer {p} could not be set up (see bench/peers/setup.sh); left out", file=sys.stderr)
    return ready


def combine(key: str, runs: list[dict]) -> dict:
    """One contender's repeats as one row: the median of their medians, the largest peak, every executor chosen."""
    failed = next((r for r in runs if "error" in r), None)
    if failed:
        return failed
    row = {**runs[0], "median_s": statistics.median(r["median_s"] for r in runs),
           "median_s_runs": [r["median_s"] for r in runs],
           "peak_memory_bytes": max(r["peak_memory_bytes"] for r in runs)}
    if "executor" in row:
        row["executor"] = "/".join(dict.fromkeys(r["executor"] for r in runs))
    for field in ("gpu_util_mean", "gpu_peak_mib", "device_peak_bytes"):
        if field in row:
            row[field] = max(r[field] for r in runs)
    return row


def ratio_range(row: dict, base: dict | None) -> str:
    """The contender's time over fedpilot's, turn by turn: 'lowest-highest' (one turn: that ratio)."""
    if base is None or "median_s_runs" not in base:
        return "-"
    ratios = [s / b for s, b in zip(row["median_s_runs"], base["median_s_runs"], strict=True)]
    return f"{min(ratios):.2f}x" if len(ratios) == 1 else f"{min(ratios):.2f}-{max(ratios):.2f}x"


def bound_of(row: dict, rows: list[dict]) -> dict | None:
    """The bound row a contender is measured against: the bf16-mixed bound for bf16-mixed contenders, else the fp32
    one (None where it did not run)."""
    key = "bound-bf16" if row["key"].endswith("-bf16") else "bound"
    return next((r for r in rows if r["key"] == key and "median_s" in r), None)


def print_table(model: str, work, rows: list[dict], flops: float, gemm: float, gemm16: float) -> None:
    base = next((r for r in rows if r["key"] == "fedpilot" and "median_s" in r), None)
    print(f"\n### {model}: {work.describe()}\n")
    print(f"FLOPs per round (forward + backward): {flops / 1e9:.2f} GFLOP; limit at the measured fp32 GEMM rate: "
          f"{flops / gemm / 1e9:.3f} s\n")
    print("| contender | s/round (median) | peak memory | x fedpilot's time (turns) | x bound | GFLOP/s | "
          "of fp32 GEMM | of bf16 GEMM |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        name = r["label"] + (f" {r['version']}" if "version" in r else "") + (
            f" [{r['executor']}]" if "executor" in r else "")
        if "error" in r:
            print(f"| {name} | failed: {' '.join(r['error'])[:80]} | | | | | | |")
            continue
        s = r["median_s"]
        gpu = (f", GPU {r['gpu_util_mean']:.0f}% util, {r['gpu_peak_mib'] / 1024:.1f} GiB"
               if "gpu_util_mean" in r else "")
        if "device_peak_bytes" in r:
            gpu += f", torch peak {r['device_peak_bytes'] / 2**30:.2f} GiB"
        ratio = ("-" if base is None else "1.00x" if r is base
                 else f"{s / base['median_s']:.2f}x ({ratio_range(r, base)})")
        bound = bound_of(r, rows)
        name += f" [batch {r['batch']}, {r['layout']}]" if "batch" in r else ""
        to_bound = "-" if bound is None else f"{s / bound['median_s']:.2f}x"
        print(f"| {name} | {s:.4f} | {r['peak_memory_bytes'] / 2**30:.2f} GiB{gpu} | {ratio} | {to_bound} | "
              f"{flops / s / 1e9:.3g} | {100 * flops / s / 1e9 / gemm:.3g}% | {100 * flops / s / 1e9 / gemm16:.3g}% |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["cnn", "mlp"], choices=sorted(WORKLOADS))
    parser.add_argument("--rounds", type=COUNT, default=7, help="rounds per contender, warm-up included")
    parser.add_argument("--warmup", type=WARMUP, default=2)
    parser.add_argument("--repeats", type=COUNT, default=3,
                        help="turns of every contender (its process run anew each time); the table gives the median")
    parser.add_argument("--device", type=device_name, default="cpu")
    parser.add_argument("--peers", nargs="*", default=["pfl", "flower"], choices=["pfl", "flower"])
    parser.add_argument("--no-peers", action="store_true", help="only fedpilot and the plain PyTorch loops")
    parser.add_argument("--no-scaling", action="store_true", help="skip fedpilot's scaling tables")
    parser.add_argument("--no-scale", action="store_true",
                        help="skip the federation-size tables (bench/scale.py: 1k to 1M clients, cohorts 10 to 1000)")
    parser.add_argument("--no-first-step", action="store_true",
                        help="skip the CNN's first local step batched over clients (bench/first_step.py)")
    parser.add_argument("--clients-per-round", type=COUNT, nargs="+", help="one table per cohort size (default: the "
                        "workload's 50; at most the workload's clients)")
    parser.add_argument("--clients", type=COUNT, help="clients in the federation (default: the workload's 1000)")
    parser.add_argument("--contenders", nargs="+", choices=sorted(CONTENDERS),
                        help="run only these (default: fedpilot, its bf16 and sequential rows, the plain loops, peers)")
    parser.add_argument("--timeout", type=POSITIVE, default=1800, help="seconds per contender")
    parser.add_argument("--gemm-seconds", type=POSITIVE, default=3.0, help="time spent measuring each GEMM rate")
    parser.add_argument("--json", type=output_file, help="also write every measurement to this file")
    args = parser.parse_args()
    check_warmup(parser, args)
    clients = args.clients or min(WORKLOADS[model].clients for model in args.models)
    if args.clients_per_round and max(args.clients_per_round) > clients:
        parser.error(f"argument --clients-per-round: {max(args.clients_per_round)} is more than the {clients} "
                     "clients of the federation")

    info = describe(args.device)
    gemm32, n32 = gemm_gflops(torch.float32, args.device, args.gemm_seconds)
    gemm16, n16 = gemm_gflops(torch.bfloat16, args.device, args.gemm_seconds)
    peers = [] if args.no_peers else ensure_peers(args.peers)
    bf16 = bf16_supported(args.device)
    keys = ["fedpilot", *(["fedpilot-bf16"] if bf16 else []), "fedpilot-sequential", "plain-reuse", "plain-fresh",
            *peers, "bound", *(["bound-bf16"] if bf16 else [])]
    if args.contenders:
        keys = [k for k in keys if k in args.contenders]
    print(f"## fedpilot vs peers ({time.strftime('%Y-%m-%d %H:%M')})\n")
    print(f"machine: {info['cpu']}, {info['cores']} cores ({info['cpu_capability']}), {info['memory_gib']} GiB"
          + (f", GPU {info['gpu']}" if "gpu" in info else "") + f"; torch {info['torch']}, "
          f"{info['torch_threads']} threads; load average before: {info['load'][0]:.2f}")
    print(f"large GEMM on {args.device}: fp32 {gemm32:.0f} GFLOP/s (n={n32}), bf16 {gemm16:.1f} GFLOP/s (n={n16})"
          + ("" if "fedpilot-bf16" in keys else "; no bf16 matmul units, so no bf16-mixed row"))
    print(f"median of {args.rounds - args.warmup} rounds after {args.warmup} warm-up rounds, then the median over "
          f"{args.repeats} turn(s) of every contender; peak memory = the largest summed PSS of the contender's process "
          "tree")
    results = {"machine": info, "gemm_gflops": {"fp32": gemm32, "bf16": gemm16}, "models": {}}
    results["tables"] = []
    for model in args.models:
        clients = args.clients or WORKLOADS[model].clients
        base = replace(WORKLOADS[model], clients=clients, clients_per_round=min(WORKLOADS[model].clients_per_round,
                                                                                 clients))
        for cohort in args.clients_per_round or [base.clients_per_round]:
            work = replace(base, clients_per_round=cohort)
            write_data(work)
            flops = flops_per_round(work)
            turns = [[run_contender(key, work, args) for key in keys] for _ in range(args.repeats)]
            rows = [combine(key, [turn[i] for turn in turns]) for i, key in enumerate(keys)]
            print_table(model, work, rows, flops, gemm32, gemm16)
            results["models"].setdefault(model, {"flops_per_round": flops, "rows": rows})
            results["tables"].append({"model": model, "clients_per_round": cohort, "flops_per_round": flops,
                                      "rows": rows})
    print(f"\nload average after: {describe(args.device)['load'][0]:.2f}")
    sys.stdout.flush()
    if not args.no_scaling:
        subprocess.run([sys.executable, "-W", "ignore", str(BENCH / "engine_throughput.py"), "--device", args.device,
                        "--gemm-gflops", str(gemm32)], check=True)
    if not args.no_scale:
        subprocess.run([sys.executable, "-W", "ignore", str(BENCH / "scale.py"), "--device", args.device], check=True)
    if not args.no_first_step and "cnn" in args.models:
        subprocess.run([sys.executable, "-W", "ignore", str(BENCH / "first_step.py"), "--device", args.device],
                       check=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
