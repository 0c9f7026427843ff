"""fedpilot at the scale of real federations: seconds per round and peak memory (host and device) against the
number of clients that exist (1k to 1M, a fixed cohort of 50 a round) and against the cohort size (10 to 1000
clients a round, a fixed federation of 10k), with a personal output layer (FedAlt: each client keeps its own
head), and the time of one evaluation of every client. bench/compare.py runs it after its other tables.

Each configuration runs in a fresh process, so its peak memory is its own. The clients' data are synthetic 8x8
uint8 images, 4 to 20 a client, written once to bench/.data/ (git-ignored; deterministic in the seed; a smaller
federation is a prefix of a larger one) and memory-mapped, so the data that exist cost disk, not memory: a
process holds in memory what it touches. The stage is a FederatedStage run by a Lightning Trainer, as `fedpilot
run` does; evaluation is off during the measured rounds (eval_every past the last round) and timed on its own.

    python bench/scale.py [--device cpu|cuda] [--sizes 1000 10000 100000 1000000] [--cohorts 10 50 200 1000]
                          [--rounds 25] [--warmup 3] [--eval-sizes 1000 100000 1000000] [--profile 15]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import logging
import os
import pstats
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import lightning as L
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "contenders"))
from arguments import COUNT, POSITIVE, SEED, WARMUP, check_warmup, device_name, output_file  # noqa: E402
from fedpilot_engine import RoundTimer  # noqa: E402
from machine import describe  # noqa: E402
from workload import DATA_DIR, RoundClock, median_after_warmup  # noqa: E402

from fedpilot.algorithms import build_algorithm  # noqa: E402
from fedpilot.data.federated import mapped  # noqa: E402
from fedpilot.engine.config import LocalConfig, StageConfig  # noqa: E402
from fedpilot.engine.data import ClientData  # noqa: E402
from fedpilot.engine.stage import FederatedStage  # noqa: E402
from fedpilot.models.split import apply_split  # noqa: E402
from fedpilot.models.zoo import build_model  # noqa: E402

SIZES = [1_000, 10_000, 100_000, 1_000_000]
COHORTS = [10, 50, 200, 1000]
EVAL_SIZES = [1_000, 100_000, 1_000_000]  # evaluated by default: 1M clients (12M samples) in 9-15 s, 0.5 GiB here
SHAPE, CLASSES, CLASSES_PER_CLIENT = (1, 8, 8), 10, 3
MIN_SAMPLES, MAX_SAMPLES = 4, 20
BLOCK = 10_000  # clients drawn from one seeded generator: a federation is a prefix of the blocks
SPLITS = ("train", "val", "test")


# ---- the synthetic federation, memory-mapped ----------------------------------------------------------------------
def data_folder(seed: int) -> Path:
    return DATA_DIR / f"scale-seed{seed}"


def stored_clients(seed: int) -> int:
    meta = data_folder(seed) / "meta.json"
    return json.loads(meta.read_text())["clients"] if meta.is_file() else 0


def _block_sizes(rng: np.random.Generator) -> np.ndarray:
    return rng.integers(MIN_SAMPLES, MAX_SAMPLES + 1, BLOCK)


def write_federation(clients: int, seed: int) -> None:
    """At least `clients` clients on disk: x [samples, 1, 8, 8] uint8, y [samples] int64, offsets and sizes [clients].

    Each class has a smooth random prototype; a sample is its class's prototype plus uniform noise, and each client
    draws its labels from 3 classes of its own (label skew). Block b of clients comes from the generator
    (seed, b), so the first n clients are the same in every file that holds them.
    """
    if stored_clients(seed) >= clients:
        return
    blocks = -(-clients // BLOCK)
    sizes = np.concatenate([_block_sizes(np.random.default_rng([seed, b])) for b in range(blocks)])
    offsets = np.cumsum(sizes) - sizes
    folder = data_folder(seed)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "meta.json").unlink(missing_ok=True)
    print(f"writing {len(sizes):,} clients ({int(sizes.sum()):,} samples) to {folder} (once) ...", file=sys.stderr)
    coarse = np.random.default_rng(seed).integers(0, 256, (CLASSES, SHAPE[0], 2, 2), dtype=np.int16)
    prototypes = coarse.repeat(SHAPE[1] // 2, axis=2).repeat(SHAPE[2] // 2, axis=3)
    x = np.lib.format.open_memmap(folder / "x.npy", "w+", np.uint8, (int(sizes.sum()), *SHAPE))
    y = np.lib.format.open_memmap(folder / "y.npy", "w+", np.int64, (int(sizes.sum()),))
    for b in range(blocks):
        rng = np.random.default_rng([seed, b])
        block_sizes = _block_sizes(rng)
        own = rng.permuted(np.tile(np.arange(CLASSES), (BLOCK, 1)), axis=1)[:, :CLASSES_PER_CLIENT]
        owner = np.repeat(np.arange(BLOCK), block_sizes)
        labels = own[owner, rng.integers(0, CLASSES_PER_CLIENT, len(owner))]
        noise = rng.integers(-48, 49, (len(owner), *SHAPE), dtype=np.int16)
        start = int(offsets[b * BLOCK])
        y[start : start + len(owner)] = labels
        x[start : start + len(owner)] = np.clip(prototypes[labels] + noise, 0, 255)
    x.flush()
    y.flush()
    np.save(folder / "sizes.npy", sizes)
    np.save(folder / "offsets.npy", offsets)
    (folder / "meta.json").write_text(json.dumps({"clients": len(sizes), "samples": int(sizes.sum()), "seed": seed}))


def federation(clients: int, seed: int) -> ClientData:
    """The first `clients` clients as the engine's ClientData over the memory-mapped arrays (mapped as the pipeline
    maps its dataset cache: `fedpilot.data.federated.mapped`); val and test are the train samples."""
    folder = data_folder(seed)
    x, y, offsets, sizes = (torch.from_numpy(mapped(folder / f"{name}.npy")) for name in ("x", "y", "offsets", "sizes"))
    offsets, sizes = offsets[:clients], sizes[:clients]
    return ClientData(x, y, dict.fromkeys(SPLITS, offsets), dict.fromkeys(SPLITS, sizes), scale=1 / 255)


# ---- one configuration, in its own process ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Config:
    clients: int
    cohort: int
    rounds: int
    warmup: int
    device: str
    seed: int = 0
    algorithm: str = "fedalt"
    evaluate: bool = False
    profile: int = 0  # top functions of the measured rounds' cProfile, by own time; 0: no profile
    cold: bool = False  # the data files out of the page cache as the process starts
    threads: int | None = None  # torch's intra-op threads; None: torch's default


def host_memory() -> dict[str, int]:
    """This process's memory now, bytes: resident set, its high-water mark, anonymous (what the process allocated)
    and file-backed (mapped files: libraries and the memory-mapped client data) resident pages."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    fields = {"rss": "VmRSS", "peak": "VmHWM", "anon": "RssAnon", "file": "RssFile"}
    return {key: int(status[field].split()[0]) * 1024 for key, field in fields.items()}


def disk_read() -> int:
    """Bytes this process has caused to be read from storage (page-cache misses of the memory-mapped data)."""
    return int(dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())["read_bytes"])


def page_cache(folder: Path, cold: bool) -> None:
    """Put the data files in the page cache (read, not mapped), or with `cold` drop their pages from it (only
    theirs), as for a federation larger than the machine's memory."""
    for file in folder.glob("*.npy"):
        fd = os.open(file, os.O_RDONLY)
        try:
            if cold:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            else:
                while os.read(fd, 2**24):
                    pass
        finally:
            os.close(fd)


class MemorySampler:
    """Peaks of the anonymous and file-backed resident memory, sampled every `interval` s on a thread (the kernel
    keeps a high-water mark of the whole resident set only)."""

    def __init__(self, interval: float = 0.01):
        self.interval, self.start = interval, host_memory()
        self.peak = dict(self.start)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = {k: max(v, self.peak[k]) for k, v in host_memory().items()}

    def reset(self) -> None:
        self.peak = host_memory()

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        self.peak = {k: max(v, self.peak[k]) for k, v in host_memory().items()}
        return self.peak


def build_stage(config: Config, data: ClientData) -> FederatedStage:
    """FedAlt with a personal output layer on the MLP 64-200-10; one round more than is run, and no evaluation, so
    the end-of-stage evaluation stays out of the measured rounds."""
    torch.manual_seed(config.seed)
    model = build_model("mlp", SHAPE, CLASSES, hidden=[200])
    stage_config = StageConfig(rounds=config.rounds + 1, clients_per_round=config.cohort, eval_every=config.rounds + 1,
                               local=LocalConfig(epochs=1, batch_size=10, lr=0.05))
    return FederatedStage(model, apply_split(model, "output_layer"), data, build_algorithm(config.algorithm),
                          stage_config, seed=config.seed)


class MeasuredRounds(L.Callback):
    """The CPU seconds of each round (all threads; less sensitive than wall time to other processes on the same
    cores), the storage read during the rounds after the warm-up, and their cProfile if asked."""

    def __init__(self, warmup: int, profile: bool):
        self.warmup, self.profile = warmup, cProfile.Profile() if profile else None
        self.read, self.cpu_times, self._cpu = 0, [], 0.0

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if batch_idx == 0:
            self._cpu = time.process_time()
        if batch_idx == self.warmup:
            self.read = -disk_read()
            if self.profile:
                self.profile.enable()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        now = time.process_time()
        self.cpu_times.append(now - self._cpu)
        self._cpu = now

    def on_train_end(self, trainer, module) -> None:
        self.read += disk_read()
        if self.profile:
            self.profile.disable()

    def top(self, count: int) -> str:
        text = io.StringIO()
        pstats.Stats(self.profile, stream=text).sort_stats("tottime").print_stats(count)
        return text.getvalue()


def measure(config: Config) -> dict:
    """Round times, host and device peaks, storage read, the bank's size; then, if asked, one evaluation of every
    client (its time and peaks)."""
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    cuda = config.device.startswith("cuda")
    if config.threads:
        torch.set_num_threads(config.threads)
    memory = MemorySampler()
    stage = build_stage(config, federation(config.clients, config.seed))
    clock, rounds = RoundClock(config.device), MeasuredRounds(config.warmup, config.profile > 0)
    trainer = L.Trainer(max_steps=config.rounds, accelerator="gpu" if cuda else "cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[RoundTimer(clock), rounds])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(stage)
    measured = config.rounds - config.warmup
    result = {"round_s": clock.times, "median_s": median_after_warmup(clock.times, config.warmup),
              "min_s": min(clock.times[config.warmup:]), "cpu_s": median_after_warmup(rounds.cpu_times, config.warmup),
              "read_per_round": rounds.read / measured,
              "host_before": memory.start, "host_peak": memory.stop(), "bank_written": stage.bank.written,
              "bank_bytes": stage.bank.nbytes(), "samples": int(stage.data.sizes["train"].sum())}
    if cuda:
        result["device_peak"] = torch.cuda.max_memory_allocated()
    if config.profile:
        result["profile"] = rounds.top(config.profile)
    if config.evaluate:
        memory = MemorySampler()
        start = time.perf_counter()
        stage.evaluate(["test"], config.rounds)
        if cuda:
            torch.cuda.synchronize()
            result["eval_device_peak"] = torch.cuda.max_memory_allocated()
        result |= {"eval_s": time.perf_counter() - start, "eval_host_before": memory.start,
                   "eval_host_peak": memory.stop()}
    return result


def run_config(config: Config, timeout: float) -> dict:
    """`measure` in a fresh interpreter (its peaks are its own), the data in the page cache or out of it;
    {"error": ...} if it fails."""
    page_cache(data_folder(config.seed), config.cold)
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [sys.executable, "-W", "ignore", __file__, "--measure", json.dumps(asdict(config)),
                   "--out", out.name]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"over {timeout:.0f} s"}
        if done.returncode != 0:
            return {"error": ((done.stderr or done.stdout).strip().splitlines() or ["failed"])[-1]}
        return json.loads(Path(out.name).read_text())


# ---- the tables -------------------------------------------------------------------------------------------------
def size(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.{2 if unit == 'GiB' else 0}f} {unit}"
    return f"{n:.0f} B"


def ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base else "-"


def grown(r: dict, key: str, before: str = "host_before", peak: str = "host_peak") -> int:
    """How much the peak of `key` memory passed its value before the data and the stage were built."""
    return r[peak][key] - r[before][key]


def print_rows(first: str, label: str, rows: list[tuple[int, dict]]) -> None:
    """One row per configuration, with ratios to the first that succeeded."""
    base = next((r for _, r in rows if "error" not in r), {})
    print(f"| {first} | s/round (median) | fastest round | x {label} | CPU s/round (median) | x {label} | "
          f"host peak RSS | host anonymous, stage's own | x {label} | mapped data pages | read from storage /round | "
          f"device peak | x {label} | bank rows written | bank bytes |")
    print("|---:" * 15 + "|")
    for n, r in rows:
        if "error" in r:
            print(f"| {n:,} | failed: {r['error'][:100]} |" + " |" * 13)
            continue
        own, base_own = grown(r, "anon"), grown(base, "anon")
        device = [size(r["device_peak"]), ratio(r["device_peak"], base["device_peak"])] if "device_peak" in r else [
            "-", "-"]
        cells = [f"{n:,}", f"{r['median_s']:.4f}", f"{r['min_s']:.4f}", ratio(r["median_s"], base["median_s"]),
                 f"{r['cpu_s']:.4f}", ratio(r["cpu_s"], base["cpu_s"]), size(r["host_peak"]["peak"]),
                 size(own), ratio(own, base_own), size(grown(r, "file")), size(r["read_per_round"]),
                 *device, f"{r['bank_written']:,}", size(r["bank_bytes"])]
        print("| " + " | ".join(cells) + " |")


def print_evaluations(rows: list[tuple[int, dict]]) -> None:
    print("\n### one evaluation of every client (after the rounds; not in s/round)\n")
    print("| clients | samples | seconds | host anonymous memory it added | device peak |")
    print("|---:|---:|---:|---:|---:|")
    for n, r in rows:
        device = size(r["eval_device_peak"]) if "eval_device_peak" in r else "-"
        print(f"| {n:,} | {r['samples']:,} | {r['eval_s']:.2f} | "
              f"{size(grown(r, 'anon', 'eval_host_before', 'eval_host_peak'))} | {device} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", type=device_name, default="cpu")
    parser.add_argument("--sizes", type=COUNT, nargs="+", default=SIZES, help="federation sizes (clients that exist)")
    parser.add_argument("--cohort", type=COUNT, default=50, help="clients per round against the federation size")
    parser.add_argument("--cohorts", type=COUNT, nargs="*", default=COHORTS, help="clients per round (none: no table)")
    parser.add_argument("--federation", type=COUNT, default=10_000, help="clients that exist against the cohort size")
    parser.add_argument("--eval-sizes", type=COUNT, nargs="*",
                        help="those of --sizes whose evaluation of every client is timed (after the rounds; "
                             "default: those of 1k, 100k and 1M among them)")
    parser.add_argument("--rounds", type=COUNT, default=25, help="rounds per configuration, warm-up included")
    parser.add_argument("--warmup", type=WARMUP, default=3)
    parser.add_argument("--cold", action="store_true",
                        help="evict the data files from the page cache before each configuration (data on storage)")
    parser.add_argument("--threads", type=COUNT, help="torch threads in each configuration (default: torch's)")
    parser.add_argument("--seed", type=SEED, default=0)
    parser.add_argument("--profile", type=WARMUP, default=0, metavar="N",
                        help="print the N functions of most own time in the measured rounds of each configuration")
    parser.add_argument("--timeout", type=POSITIVE, default=900, help="seconds per configuration")
    parser.add_argument("--json", type=output_file, help="also write every configuration's measurements to this file")
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # one configuration (JSON), in this process
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        Path(args.out).write_text(json.dumps(measure(Config(**json.loads(args.measure)))))
        return
    check_warmup(parser, args)
    if args.eval_sizes is None:
        args.eval_sizes = [n for n in args.sizes if n in EVAL_SIZES]
    if set(args.eval_sizes) - set(args.sizes):
        parser.error(f"--eval-sizes {sorted(set(args.eval_sizes) - set(args.sizes))}: not among --sizes")
    if args.cohort > min(args.sizes):
        parser.error(f"argument --cohort: {args.cohort} is more than the {min(args.sizes)} clients of the smallest "
                     "of --sizes")
    if args.cohorts and max(args.cohorts) > args.federation:
        parser.error(f"argument --cohorts: {max(args.cohorts)} is more than the {args.federation} clients of "
                     "--federation")
    write_federation(max([*args.sizes, args.federation if args.cohorts else 0]), args.seed)

    def run(clients: int, cohort: int, evaluate: bool = False) -> dict:
        config = Config(clients, cohort, args.rounds, args.warmup, args.device, args.seed,
                        evaluate=evaluate, profile=args.profile, cold=args.cold, threads=args.threads)
        return run_config(config, args.timeout)

    info = describe(args.device)
    print(f"\n## fedpilot at federation scale ({time.strftime('%Y-%m-%d %H:%M')}, {args.device})\n")
    print(f"machine: {info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB"
          + (f", GPU {info['gpu']}" if "gpu" in info else "") + f"; torch {info['torch']}, "
          f"{args.threads or info['torch_threads']} threads; load average before: {info['load'][0]:.2f}")
    print(f"FedAlt, MLP 64-200-10 with a personal output layer (2,010 parameters a client), 8x8 uint8 inputs, "
          f"{MIN_SAMPLES}-{MAX_SAMPLES} samples a client, batch 10, 1 local epoch per phase; median of "
          f"{args.rounds - args.warmup} rounds after {args.warmup}; each configuration in a fresh process; data "
          + ("evicted from the page cache first" if args.cold else "in the page cache (warm)") + "\n")
    by_size = [(n, run(n, args.cohort, n in args.eval_sizes)) for n in args.sizes]
    print(f"### against the clients that exist ({args.cohort} clients a round)\n")
    print_rows("clients", f"{args.sizes[0]:,}", by_size)
    if args.cohorts:
        done = dict(by_size) if args.cohort in args.cohorts else {}
        by_cohort = [(k, done[args.federation] if k == args.cohort and args.federation in done
                      else run(args.federation, k)) for k in args.cohorts]
        print(f"\n### against the clients per round ({args.federation:,} clients)\n")
        print_rows("clients/round", str(args.cohorts[0]), by_cohort)
    evaluated = [(n, r) for n, r in by_size if "eval_s" in r]
    if evaluated:
        print_evaluations(evaluated)
    for n, r in by_size:
        if "profile" in r:
            print(f"\n### profile of the measured rounds, {n:,} clients\n\n```\n{r['profile'].strip()}\n```")
    print(f"\nload average after: {describe(args.device)['load'][0]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "by_size": dict(by_size),
                                               "by_cohort": dict(by_cohort) if args.cohorts else {}}, indent=1))


if __name__ == "__main__":
    main()
