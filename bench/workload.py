"""The one workload every contender runs, defined once: FedAvg of a small model over 1000 clients.

Only torch and numpy are imported here, so the peers' virtual environments (bench/.venvs/) run the same
definition: the same model (layer for layer the fedpilot zoo's `cnn` / `mlp`, with the same parameter
names), the same client data (synthetic class-prototype images written once to bench/.data/ as .npy,
deterministic in the seed, no network), and the same local work (batch 10, one epoch, plain SGD).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

DATA_DIR = Path(__file__).resolve().parent / ".data"


@dataclass(frozen=True)
class Workload:
    """FedAvg: `clients` clients of `samples` training samples, `clients_per_round` sampled per round,
    each doing `epochs` local epochs of SGD (lr `lr`) in batches of `batch_size`, then a weighted mean."""

    model: str = "cnn"
    width: int = 512
    clients: int = 1000
    samples: int = 20
    clients_per_round: int = 50
    batch_size: int = 10
    epochs: int = 1
    lr: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        if self.model not in ("cnn", "mlp"):
            raise ValueError(f"model {self.model!r}: cnn or mlp")
        counts = {n: getattr(self, n) for n in ("width", "clients", "samples", "clients_per_round", "batch_size",
                                                 "epochs")}
        small = [f"{n}={v}" for n, v in counts.items() if not isinstance(v, int) or v < 1]
        if small or not self.lr > 0:
            raise ValueError(f"{', '.join(small) or f'lr={self.lr}'}: counts are integers of at least 1, lr > 0")
        if self.clients_per_round > self.clients:
            raise ValueError(f"clients_per_round={self.clients_per_round}: more than the {self.clients} clients")

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return (1, 28, 28) if self.model == "cnn" else (1, 8, 8)

    @property
    def classes(self) -> int:
        return 62 if self.model == "cnn" else 10

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Workload:
        """The workload of its JSON (`to_json`); an argparse type."""
        import argparse

        try:
            return cls(**json.loads(text))
        except (TypeError, ValueError) as err:
            raise argparse.ArgumentTypeError(f"{text!r}: not a workload ({err})") from None

    def describe(self) -> str:
        shape = "x".join(map(str, self.input_shape))
        return (f"FedAvg, {self.model} (width {self.width}) on {shape} inputs, {self.clients} clients x "
                f"{self.samples} samples, {self.clients_per_round} clients/round, batch {self.batch_size}, "
                f"{self.epochs} local epoch(s), lr {self.lr}")


WORKLOADS = {"cnn": Workload("cnn", 512), "mlp": Workload("mlp", 200)}


class Net(nn.Module):
    """head(body(x)), the fedpilot zoo's layout, so state dicts carry the same names everywhere."""

    def __init__(self, body: nn.Module, head: nn.Linear):
        super().__init__()
        self.body, self.head = body, head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def build_model(work: Workload) -> Net:
    """The 2-conv CNN of FedAvg (McMahan et al. 2017) or the one-hidden-layer MLP, seeded by the workload."""
    torch.manual_seed(work.seed)
    channels, height, width = work.input_shape
    if work.model == "cnn":
        body = nn.Sequential(
            nn.Conv2d(channels, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64 * (height // 4) * (width // 4), work.width), nn.ReLU())
    elif work.model == "mlp":
        body = nn.Sequential(nn.Flatten(), nn.Linear(channels * height * width, work.width), nn.ReLU())
    else:
        raise ValueError(f"workload model {work.model!r}: expected 'cnn' or 'mlp'")
    return Net(body, nn.Linear(work.width, work.classes))


def data_paths(work: Workload) -> tuple[Path, Path]:
    stem = f"{work.model}-{work.clients}x{work.samples}-seed{work.seed}"
    return DATA_DIR / f"{stem}-x.npy", DATA_DIR / f"{stem}-y.npy"


def write_data(work: Workload) -> None:
    """Client-major inputs [clients, samples, C, H, W] and labels [clients, samples], once per workload.

    Each class has a smooth random prototype image; a sample is its class prototype plus noise, and each
    client draws its labels from 5 classes of its own (label skew, as in the FL benchmarks).
    """
    x_path, y_path = data_paths(work)
    if x_path.exists() and y_path.exists():
        return
    rng = np.random.default_rng(work.seed)
    c, h, w = work.input_shape
    coarse = rng.normal(size=(work.classes, c, (h + 3) // 4, (w + 3) // 4))
    prototypes = coarse.repeat(4, axis=2).repeat(4, axis=3)[:, :, :h, :w]
    own = np.stack([rng.choice(work.classes, 5, replace=False) for _ in range(work.clients)])
    y = np.take_along_axis(own, rng.integers(0, 5, size=(work.clients, work.samples)), axis=1)
    x = prototypes[y] + rng.normal(scale=1.0, size=(work.clients, work.samples, c, h, w))
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    np.save(x_path, x.astype(np.float32))
    np.save(y_path, y.astype(np.int64))


def load_data(work: Workload) -> tuple[np.ndarray, np.ndarray]:
    """The workload's arrays, memory-mapped (a process touches only the clients it trains)."""
    x_path, y_path = data_paths(work)
    return np.load(x_path, mmap_mode="r"), np.load(y_path, mmap_mode="r")


def sample_cohort(work: Workload, round_idx: int) -> list[int]:
    """The clients of one round (uniform without replacement), for the contenders that sample themselves."""
    rng = np.random.default_rng([work.seed, round_idx])
    return sorted(rng.choice(work.clients, work.clients_per_round, replace=False).tolist())


def local_batches(work: Workload, client: int, round_idx: int) -> list[np.ndarray]:
    """Index batches of one client's local epochs: a fresh shuffle per epoch, the last batch may be short."""
    rng = np.random.default_rng([work.seed, round_idx, client])
    order = np.concatenate([rng.permutation(work.samples) for _ in range(work.epochs)])
    return [order[i : i + work.batch_size] for i in range(0, len(order), work.batch_size)]


def flops_per_round(work: Workload) -> float:
    """Forward + backward FLOPs of one round (torch's FLOP counter on one batch, times the samples trained)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = build_model(work)
    x = torch.zeros(work.batch_size, *work.input_shape)
    with FlopCounterMode(display=False) as counter:
        nn.functional.cross_entropy(model(x), torch.zeros(work.batch_size, dtype=torch.long)).backward()
    per_sample = counter.get_total_flops() / work.batch_size
    return per_sample * work.samples * work.epochs * work.clients_per_round


def median_after_warmup(times: list[float], warmup: int) -> float:
    return statistics.median(times[warmup:])


class RoundClock:
    """Wall-clock seconds of each round (CUDA work is synchronized before reading the clock)."""

    def __init__(self, device: str = "cpu"):
        self.device, self.times, self._start = device, [], None

    def start(self) -> None:
        self._sync()
        self._start = time.perf_counter()

    def stop(self) -> None:
        self._sync()
        self.times.append(time.perf_counter() - self._start)

    def _sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()


def report(out: str, contender: str, work: Workload, times: list[float], warmup: int, **extra) -> None:
    """Write one contender's result as JSON for the driver (bench/compare.py)."""
    result = {"contender": contender, "workload": json.loads(work.to_json()), "round_s": times,
              "median_s": median_after_warmup(times, warmup), "torch": torch.__version__,
              "threads": torch.get_num_threads(), "python": sys.version.split()[0], **extra}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        result["device_peak_bytes"] = torch.cuda.max_memory_allocated()
    Path(out).write_text(json.dumps(result))


def contender_args(description: str, extra: dict[str, dict] | None = None):
    """The command line every contender takes from the driver: workload, rounds, device, output file (the driver's
    own temporary file: a contender in a peer's environment has no fedpilot to check it with)."""
    import argparse

    from arguments import COUNT, WARMUP, check_warmup, device_name

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--workload", type=Workload.from_json, default=WORKLOADS["cnn"])
    parser.add_argument("--rounds", type=COUNT, default=7, help="rounds run, warm-up included")
    parser.add_argument("--warmup", type=WARMUP, default=2)
    parser.add_argument("--device", type=device_name, default="cpu")
    parser.add_argument("--out", required=True)
    for flag, options in (extra or {}).items():
        parser.add_argument(flag, **options)
    args = parser.parse_args()
    check_warmup(parser, args)
    write_data(args.workload)
    return args
