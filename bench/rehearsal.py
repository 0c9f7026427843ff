"""Real-size federations rehearsed offline (issue 34): writes seeded stand-ins with the hub datasets' schemas and
sizes (FEMNIST: 3,550 writers, ~805k 28x28 PNG images; Stack Overflow: 342k users, ~135M tokens of word-like
text), scaled by --fraction, then measures the real commands on them as subprocesses of `fedpilot`: validate cold
(the build) and warm, data describe, 20 rounds of the shipped hub pipeline's first stage with the stage-end
evaluation of every client; wall time, peak RSS and bytes on disk of each, and where the run's time and memory go
(read from the MLflow run it made and from RSS sampled through the run).

    python bench/rehearsal.py --fraction 0.01
    python bench/rehearsal.py --only stackoverflow --users 1000 --json so1000.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import get_args

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
FEMNIST = {"writers": 3550, "mean": 226.8, "sd": 88.9}  # LEAF's FEMNIST: 805,263 images over 3,550 writers
SO = {"users": 342_477, "tokens": 135_000_000, "sentence": 13.0, "sigma": 1.3}  # TFF's Stack Overflow train split
SHARD_ROWS = 200_000  # rows per parquet file written
MiB = 2**20


# ---------------------------------------------------------------- stand-ins


def femnist_sizes(writers: int, rng: np.random.Generator) -> np.ndarray:
    """Images per writer: a gamma with FEMNIST's mean and spread, at least 1."""
    shape, scale = (FEMNIST["mean"] / FEMNIST["sd"]) ** 2, FEMNIST["sd"] ** 2 / FEMNIST["mean"]
    return np.maximum(1, np.rint(rng.gamma(shape, scale, writers))).astype(np.int64)


def write_femnist(folder: Path, writers: int, seed: int) -> dict:
    """Parquet files with flwrlabs/femnist's columns: PNG `image` (28x28, L), string `writer_id`, ClassLabel
    `character` (62); per class a smooth prototype plus per-image noise, so a model has something to learn."""
    import io

    import datasets
    from PIL import Image

    rng = np.random.default_rng([seed, 34, 0])
    sizes = femnist_sizes(writers, rng)
    coarse = rng.integers(0, 256, (62, 7, 7)).astype(np.float32)
    prototypes = np.kron(coarse, np.ones((4, 4), np.float32))
    features = datasets.Features({"image": datasets.Image(), "writer_id": datasets.Value("string"),
                                  "character": datasets.ClassLabel(num_classes=62)})
    owner = np.repeat(np.arange(writers), sizes)
    folder.mkdir(parents=True, exist_ok=True)
    for shard, start in enumerate(range(0, len(owner), SHARD_ROWS)):
        who = owner[start : start + SHARD_ROWS]
        labels = rng.integers(0, 62, len(who))
        pixels = np.clip(prototypes[labels] + rng.normal(0, 40, (len(who), 28, 28)), 0, 255).astype(np.uint8)
        pngs = []
        for image in pixels:
            buffer = io.BytesIO()
            Image.fromarray(image, mode="L").save(buffer, format="PNG")
            pngs.append({"bytes": buffer.getvalue(), "path": None})
        table = datasets.Dataset.from_dict({"image": pngs, "writer_id": [f"f{w:04d}_{w * 7919 % 100:02d}" for w in who],
                                            "character": labels.tolist()}, features=features)
        table.to_parquet(str(folder / f"train-{shard:05d}.parquet"))
    return {"clients": writers, "samples": int(sizes.sum()), "eligible": int((sizes >= 10).sum()),
            "path": str(folder / "*.parquet")}


def word_list(n: int, rng: np.random.Generator) -> np.ndarray:
    """n distinct lower-case word-like strings, short ones first (they take the Zipf head)."""
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    weights = np.linspace(2.0, 0.2, len(letters))
    weights /= weights.sum()
    words: dict[str, None] = {}
    while len(words) < n:
        for length in np.sort(rng.integers(1, 11, 4 * n)):
            words.setdefault("".join(rng.choice(letters, length, p=weights)), None)
            if len(words) == n:
                break
    return np.array(list(words), dtype=object)


def so_sizes(users: int, rng: np.random.Generator, at_least: int) -> np.ndarray:
    """Sentences per user: lognormal with the mean that gives ~135M tokens over 342k users; a user below
    `at_least` is drawn again (the subset a paper keeps)."""
    mean = SO["tokens"] / SO["users"] / SO["sentence"]
    mu = np.log(mean) - SO["sigma"] ** 2 / 2
    sizes = np.zeros(0, dtype=np.int64)
    while len(sizes) < users:
        draw = np.maximum(1, np.rint(rng.lognormal(mu, SO["sigma"], 2 * users))).astype(np.int64)
        sizes = np.concatenate([sizes, draw[draw >= at_least]])
    return sizes[:users]


def write_stackoverflow(folder: Path, users: int, seed: int, at_least: int = 1) -> dict:
    """Parquet files with TFF Stack Overflow's columns as the hub preset reads them: `tokens` (one sentence of
    space-separated lower-case words) and string `user_id`; words drawn from a Zipf law over 50,000 types."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng([seed, 34, 1])
    sizes = so_sizes(users, rng, at_least)
    words = word_list(50_000, rng)
    rank = np.arange(1, len(words) + 1, dtype=np.float64)
    cdf = np.cumsum(1 / (rank + 2.7) ** 1.07)
    cdf /= cdf[-1]
    owner = np.repeat(np.arange(users), sizes)
    folder.mkdir(parents=True, exist_ok=True)
    tokens = 0
    for shard, start in enumerate(range(0, len(owner), SHARD_ROWS * 5)):
        who = owner[start : start + SHARD_ROWS * 5]
        lengths = np.maximum(1, rng.poisson(SO["sentence"] - 1, len(who)) + 1)
        ids = np.minimum(np.searchsorted(cdf, rng.random(int(lengths.sum()))), len(words) - 1)
        flat = words[ids]
        cuts = np.cumsum(lengths)[:-1]
        text = [" ".join(s) for s in np.split(flat, cuts)]
        tokens += int(lengths.sum())
        table = pa.table({"tokens": pa.array(text, pa.string()),
                          "user_id": pa.array([f"{u:08d}" for u in who], pa.string())})
        pq.write_table(table, folder / f"train-{shard:05d}.parquet")
    return {"clients": users, "samples": int(sizes.sum()), "tokens": tokens,
            "eligible": int((sizes >= 100).sum()), "path": str(folder / "*.parquet")}


# ---------------------------------------------------------------- measuring


@dataclass
class Measured:
    """One command's wall time, peak RSS (the process and its children, sampled) and RSS over time."""

    name: str
    command: list[str]
    seconds: float = 0.0
    peak_rss: int = 0
    samples: list[tuple[float, int]] = field(default_factory=list)
    output: str = ""
    rc: int = 0
    cpu_seconds: float = 0.0  # user + system, all threads: what the load of other processes does not stretch


def tree_rss(pid: int) -> int:
    """Summed RSS of a process and its descendants."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            total += proc.memory_info().rss
    return total


def measure(name: str, command: list[str], env: dict[str, str], interval: float = 0.1) -> Measured:
    """Run `command`, sampling its tree's RSS every `interval` s; its stdout and stderr kept."""
    result = Measured(name, command)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.time()
    proc = subprocess.Popen(command, cwd=env["REHEARSAL_DIR"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    done = threading.Event()

    def sample() -> None:
        while not done.wait(interval):
            rss = tree_rss(proc.pid)
            result.samples.append((time.time(), rss))
            result.peak_rss = max(result.peak_rss, rss)

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    result.output = proc.communicate()[0]
    done.set()
    watcher.join()
    result.seconds, result.rc = time.time() - start, proc.returncode
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    result.cpu_seconds = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    if proc.returncode != 0:
        print(result.output[-3000:], file=sys.stderr)
        raise SystemExit(f"{name}: {' '.join(command)} exited {proc.returncode}")
    return result


def disk_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


CLIP = 1.0


def hydra_value(value: object) -> str:
    """A value in Hydra's override grammar."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if value is None:
        return "null"
    return str(value).lower() if isinstance(value, bool) else str(value)


def first_stage(pipeline: Path, rounds: int, clients: int, keys: dict) -> str:
    """`stages=[...]`: the pipeline's first stage only (with `keys` set), `rounds` rounds and at most `clients` a
    round, its gradients clipped at norm CLIP unless it clips them already: the stand-ins' random images are harder
    than the real ones, and FEMNIST's lr 0.5 diverged on them within 20 rounds with one executor's rounding and not
    another's (2026-11-26), which would end the measurement, not say anything about memory or time."""
    import yaml

    stage = yaml.safe_load(pipeline.read_text())["stages"][0]
    cohort = min(stage.get("clients_per_round", clients), clients)
    local = {"clip_norm": CLIP, **stage.get("local", {})}
    return "stages=" + hydra_value([{**stage, **keys, "rounds": rounds, "clients_per_round": cohort, "local": local}])


def fitted(pipeline: Path, clients: int) -> list[str]:
    """Overrides that fit the pipeline to a stand-in of `clients` clients: at most that many a round."""
    import yaml

    stages = yaml.safe_load(pipeline.read_text())["stages"]
    return [f"dataset.partition.clients={clients}"] + [
        f"stages.{i}.clients_per_round={clients}" for i, s in enumerate(stages)
        if s.get("clients_per_round", 0) > clients]


def phases(run: Measured, tracking: str, run_id: str) -> dict:
    """Where the run's time and memory went, from its MLflow stage run and the RSS sampled: the process's start up
    to the stage run (imports, data, model), the first round (with the executor timing, `executor_timing_s`, and
    the fit's start: together the first round's time less its `round_time_s`), the middle rounds, the last round
    (with the stage-end evaluation of every client: its time less `round_time_s`), and the report and closing."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking)
    parent = client.get_run(run_id)
    stage = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{run_id}'")[0]
    logged = [m.timestamp / 1e3 for m in client.get_metric_history(stage.info.run_id, "train_loss")]
    round_s = [m.value for m in client.get_metric_history(stage.info.run_id, "round_time_s")]
    marks = [("start", run.samples[0][0] - 0.1), ("stage run", stage.info.start_time / 1e3),
             ("first round", logged[0]), ("last round but one", logged[-2]), ("last round", logged[-1]),
             ("end", run.samples[-1][0])]
    out = {"executor_seconds": {k.removeprefix("executor_seconds_"): round(v, 3) for k, v in stage.data.metrics.items()
                                if k.startswith("executor_seconds_")},
           "round_time_s_median": round(float(np.median(round_s)), 3),
           "executor_timing_s": round(stage.data.metrics.get("executor_timing_s", float("nan")), 2),
           "first_round_overhead_s": round(logged[0] - stage.info.start_time / 1e3 - round_s[0], 2),
           "evaluation_s": round(logged[-1] - logged[-2] - round_s[-1], 2),
           "stage_peak_memory_bytes": stage.data.metrics.get("peak_memory_bytes"), "phases": {}}
    for (a, t0), (b, t1) in zip(marks, marks[1:], strict=False):
        inside = [rss for t, rss in run.samples if t0 <= t <= t1]
        out["phases"][f"{a} -> {b}"] = {"seconds": round(t1 - t0, 2), "peak_rss": max(inside, default=0)}
    return out


def evaluated_samples(entry: Path) -> int:
    """The val and test samples (or windows) of a cache entry: what the stage-end evaluation runs over."""
    index = np.load(entry / "index.npz")
    return int(index["sizes_val"].sum() + index["sizes_test"].sum())


def plain_forward(model: str, shape: tuple[int, ...], classes: int, options: dict | None = None) -> dict:
    """Samples per second of the model's plain forward pass (torch.no_grad, float32 inputs already made) at its
    best batch of 32 ... 4096, in this process: what the evaluation is held against."""
    import torch

    from fedpilot.models.zoo import build_model

    net = build_model(model, shape, classes, **(options or {})).eval()
    inputs = (torch.randint(0, classes, (4096, *shape)) if len(shape) == 1 else torch.rand(4096, *shape))
    rates = {}
    with torch.no_grad():
        for batch in (32, 128, 512, 1024, 4096):
            net(inputs[:batch])
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                for i in range(0, 4096, batch):
                    net(inputs[i : i + batch])
                best = min(best, time.perf_counter() - start)
            rates[batch] = 4096 / best
    batch = max(rates, key=rates.__getitem__)
    return {"best_batch": batch, "samples_per_s": round(rates[batch], 1)}


def rehearse(name: str, info: dict, pipeline: Path, extra: list[str], clients: int, out: Path, rounds: int,
             full_build: bool, stage_keys: dict) -> dict:  # rounds 0: only the data commands
    """The commands on one stand-in (`clients` of its clients kept), in a fresh cache and MLflow store under
    `out`."""
    cache, tracking = out / f"{name}-cache", f"sqlite:///{out / f'{name}-mlflow.db'}"
    hf_cache = out / f"{name}-hf"
    for path in (cache, hf_cache, out / f"{name}-mlflow.db", out / f"{name}-artifacts"):
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    env = {**os.environ, "FEDPILOT_CACHE": str(cache), "MLFLOW_TRACKING_URI": tracking, "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(hf_cache), "REHEARSAL_DIR": str(out / f"{name}-artifacts")}
    (out / f"{name}-artifacts").mkdir()  # the commands' working folder: MLflow's local artifacts land there
    fedpilot = [sys.executable, "-m", "fedpilot.cli"]
    overrides = [f"dataset.source.path={info['path']}", *extra, *fitted(pipeline, clients)]
    rows = []

    def row(measured: Measured, on_disk: int, note: str = "") -> None:
        rows.append({"command": measured.name, "seconds": round(measured.seconds, 2),
                     "cpu_seconds": round(measured.cpu_seconds, 1), "peak_rss": measured.peak_rss,
                     "disk_bytes": on_disk, "note": note})
        print(f"  {measured.name:<34} {measured.seconds:8.1f} s ({measured.cpu_seconds:7.1f} CPU s)  "
              f"{measured.peak_rss / MiB:8.0f} MiB  "
              f"{on_disk / MiB:8.1f} MiB  {note}", flush=True)

    data_disk = lambda: disk_bytes(cache / "data") + disk_bytes(hf_cache)  # noqa: E731
    row(measure("validate (cold: the build)", [*fedpilot, "validate", str(pipeline), *overrides], env), data_disk(),
        "cache + datasets' arrow copy")
    row(measure("validate (warm)", [*fedpilot, "validate", str(pipeline), *overrides], env), data_disk())
    described = measure("data describe", [*fedpilot, "data", "describe", "--json", str(pipeline), *overrides], env)
    summary = json.loads(described.output[described.output.index("{"):])
    row(described, disk_bytes(cache / "data"), f"{summary.get('clients', summary.get('n_clients', '?'))} clients")
    if full_build:
        every = [o for o in overrides if not o.startswith(("dataset.partition.", "stages."))] + [
            "dataset.partition.clients=null", "dataset.partition.min_size=1"]
        # `data describe` builds what is not cached and checks no stage: validate would refuse the pipeline's
        # later stages over every user (a batch plan of every client at once), after the build
        row(measure("data describe (cold: the build), every user", [*fedpilot, "data", "describe", str(pipeline),
                                                                     *every], env),
            disk_bytes(cache / "data"), "dataset.partition.clients=null min_size=1")
    if not rounds:
        return {"standin": info, "rows": rows, "summary": summary}
    run = measure(f"run: {rounds} rounds + evaluation", [*fedpilot, "run", "--no-progress", str(pipeline), *overrides,
                                                          first_stage(pipeline, rounds, clients, stage_keys)], env)
    run_id = run.output.rsplit("run_id:", 1)[1].split()[0]
    row(run, disk_bytes(cache) + disk_bytes(out / f"{name}-artifacts"), "cache + MLflow artifacts")
    where = phases(run, tracking, run_id)
    for phase, value in where["phases"].items():
        print(f"    {phase:<40} {value['seconds']:8.1f} s  peak {value['peak_rss'] / MiB:8.0f} MiB")
    print(f"    executor timing {where['executor_timing_s']} s of the first round's "
          f"{where['first_round_overhead_s']} s beyond its round (candidates' seconds {where['executor_seconds']}), "
          f"evaluation of every client {where['evaluation_s']} s, a round {where['round_time_s_median']} s")
    where["evaluated_samples"] = evaluated_samples(cache / "data" / summary["fingerprint"])
    if where["evaluation_s"] > 0:
        where["evaluation_samples_per_s"] = round(where["evaluated_samples"] / where["evaluation_s"], 1)
    result = {"standin": info, "rows": rows, "phases": where, "summary": summary,
              "rss_samples": [(round(t - run.samples[0][0], 2), rss) for t, rss in run.samples[::5]]}
    return result


def markdown(files: list[Path]) -> str:
    """The measured rows of rehearsal JSON files as one Markdown table, and each run's phases."""
    lines = ["| stand-in | command | wall s | CPU s | peak RSS MiB | on disk MiB | note |",
             "|---|---|---:|---:|---:|---:|---|"]
    notes = []
    for file in files:
        result = json.loads(file.read_text())
        load = ", ".join(f"{v:.1f}" for v in result["load_before"])
        for name in ("femnist", "stackoverflow"):
            if name not in result:
                continue
            info = result[name]["standin"]
            what = (f"{name} {info['clients']:,} {'writers' if name == 'femnist' else 'users'}, "
                    f"{info['samples']:,} {'images' if name == 'femnist' else 'sentences'}"
                    + (f", {info['tokens'] / 1e6:.1f}M tokens" if "tokens" in info else "")
                    + f" ({info['bytes'] / MiB:.0f} MiB parquet; load {load})")
            for row in result[name]["rows"]:
                cpu = f"{row['cpu_seconds']:.0f}" if "cpu_seconds" in row else "-"
                lines.append(f"| {what} | {row['command']} | {row['seconds']:.1f} | {cpu} | "
                             f"{row['peak_rss'] / MiB:.0f} | {row['disk_bytes'] / MiB:.1f} | {row['note']} |")
                what = ""
            if "phases" in result[name]:
                where = result[name]["phases"]
                parts = "; ".join(f"{k} {v['seconds']:.1f} s (peak {v['peak_rss'] / MiB:.0f} MiB)"
                                  for k, v in where["phases"].items())
                forward = result[name].get("plain_forward")
                notes.append(f"- {name}, {info['clients']:,} clients: {parts}. Executor timing "
                             f"~{where['executor_timing_s']} s, a round {where['round_time_s_median']} s, "
                             "the stage-end evaluation of every client "
                             f"{where['evaluation_s']} s over {where['evaluated_samples']:,} samples"
                             + (f" ({where.get('evaluation_samples_per_s')} samples/s; the plain forward "
                                f"{forward['samples_per_s']} at batch {forward['best_batch']})" if forward else "")
                             + ".")
    return "\n".join(lines + [""] + notes)


def written(folder: Path, write, *args) -> dict:
    """A stand-in's description: the one saved beside its files (written before with the same arguments), else
    the stand-in written now."""
    saved = folder / "standin.json"
    if saved.is_file():
        return json.loads(saved.read_text())
    start = time.time()
    info = write(folder, *args)
    info.update(write_seconds=round(time.time() - start, 1), bytes=disk_bytes(folder))
    saved.write_text(json.dumps(info))
    return info


def main() -> None:
    from arguments import COUNT, FRACTION, SEED, input_file, output_file, output_folder

    from fedpilot.engine.config import StageConfig
    from fedpilot.models.options import MODELS, reads_tokens

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fraction", type=FRACTION, default=0.01, help="share of the true sizes (1 = true sizes)")
    parser.add_argument("--users", type=COUNT, default=None, help="this many writers/users instead")
    parser.add_argument("--only", choices=["femnist", "stackoverflow"], default=None)
    parser.add_argument("--out", type=output_folder, default=Path(tempfile.gettempdir()) / "fedpilot-rehearsal")
    parser.add_argument("--json", type=output_file, default=None)
    parser.add_argument("--rounds", type=COUNT, default=20)
    parser.add_argument("--so-rounds", type=COUNT, default=None, help="rounds of the Stack Overflow run (default "
                        "--rounds; a round of 50 transformer clients is minutes on 2 cores)")
    parser.add_argument("--femnist-model", default="cnn", choices=[m for m in MODELS.builtins if not reads_tokens(m)],
                        help="model of the FEMNIST run (the issue's CNN; the shipped pipeline names resnet18)")
    parser.add_argument("--seed", type=SEED, default=0)
    parser.add_argument("--execution", default=None, choices=get_args(StageConfig.model_fields["execution"].annotation),
                        help="pin the run's executor (default: the pipeline's, auto)")
    parser.add_argument("--skip-run", action="store_true", help="only the data commands (validate, describe)")
    parser.add_argument("--full-build", action="store_true", help="also build Stack Overflow with every user")
    parser.add_argument("--table", type=input_file, nargs="+", default=None,
                        help="print these JSON results as Markdown")
    args = parser.parse_args()
    if args.table:
        print(markdown(args.table))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"load {os.getloadavg()}, {os.cpu_count()} cores", flush=True)
    stage_keys = {"execution": args.execution} if args.execution else {}
    results: dict = {"fraction": args.fraction, "users": args.users, "load_before": os.getloadavg()}
    if args.only in (None, "femnist"):
        writers = args.users or max(10, round(FEMNIST["writers"] * args.fraction))
        info = written(args.out / "femnist-standin" / f"{writers}-seed{args.seed}", write_femnist, writers, args.seed)
        print(f"FEMNIST stand-in: {info}", flush=True)
        results["femnist"] = rehearse("femnist", info, ROOT / "pipelines" / "femnist-fedalt.yaml",
                                      [f"model={args.femnist_model}"], min(1114, info["eligible"]), args.out,
                                      0 if args.skip_run else args.rounds, False, stage_keys)
        if not args.skip_run:
            results["femnist"]["plain_forward"] = plain_forward(args.femnist_model, (1, 28, 28), 62)
            print(f"    plain forward of the {args.femnist_model}: {results['femnist']['plain_forward']}; the "
                  f"evaluation: {results['femnist']['phases'].get('evaluation_samples_per_s')} samples/s")
    if args.only in (None, "stackoverflow"):
        users = args.users or max(20, round(SO["users"] * args.fraction))
        info = written(args.out / "so-standin" / f"{users}-seed{args.seed}-{'kept' if args.users else 'all'}",
                       write_stackoverflow, users, args.seed, 100 if args.users else 1)
        print(f"Stack Overflow stand-in: {info}", flush=True)
        results["stackoverflow"] = rehearse("stackoverflow", info, ROOT / "pipelines" / "stackoverflow-fedalt.yaml",
                                            [], min(1000, info["eligible"]), args.out,
                                            0 if args.skip_run else args.so_rounds or args.rounds, args.full_build,
                                            stage_keys)
    results["load_after"] = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
