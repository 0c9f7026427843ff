"""Issue 34, reduced: bench/rehearsal.py at 1% of the true sizes (`--fraction 0.01 --skip-run`: the data commands
on FEMNIST- and Stack Overflow-schema stand-ins), a build of its FEMNIST stand-in killed (kill -9) while it writes
its cache entry, and the fixes the full-size rehearsal called for (packing text windows
without a Python list per text, a progress callback, a memory cap on executor trials, a bounded timing)."""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from fedpilot.data.config import DatasetSpec
from fedpilot.data.federated import build_federated_data, fingerprint, remove_abandoned, reporting
from fedpilot.data.text import pack_runs, pack_windows, stream_of
from fedpilot.engine.accel import timing

ROOT = Path(__file__).resolve().parent.parent
PIPELINE = ROOT / "pipelines" / "femnist-fedalt.yaml"
_spec = importlib.util.spec_from_file_location("rehearsal", ROOT / "bench" / "rehearsal.py")
rehearsal = sys.modules.setdefault("rehearsal", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(rehearsal)


@pytest.fixture(scope="module")
def reduced(tmp_path_factory) -> dict:
    """`bench/rehearsal.py --fraction 0.01 --skip-run`: both stand-ins at 1% of the true sizes and the data commands
    on them (its JSON result)."""
    out = tmp_path_factory.mktemp("rehearsal")
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "rehearsal.py"), "--fraction", "0.01", "--skip-run",
                           "--out", str(out), "--json", str(out / "r.json")], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads((out / "r.json").read_text())


@pytest.mark.parametrize(("name", "clients", "per_client"), [("femnist", 36, 100), ("stackoverflow", 3425, 10)])
def test_the_reduced_rehearsal_measures_the_data_commands_on_hub_schema_standins(reduced, name, clients, per_client):
    standin, rows, summary = reduced[name]["standin"], reduced[name]["rows"], reduced[name]["summary"]
    assert standin["clients"] == clients and standin["samples"] > per_client * clients  # 1% of the writers / users
    assert [r["command"] for r in rows] == ["validate (cold: the build)", "validate (warm)", "data describe"]
    assert all(r["peak_rss"] > 0 and r["disk_bytes"] > 0 for r in rows)
    assert rows[1]["seconds"] < rows[0]["seconds"]  # the warm validate loads what the cold one built
    # the pipelines keep the writers / users with enough data (Stack Overflow's min_size: 100 sentences)
    assert summary["clients"] == standin["eligible"] > 0 and summary["cache_hit"] is True
    samples = sum(summary["samples"].values()) if isinstance(summary["samples"], dict) else summary["samples"]
    assert samples > 0
    if name == "stackoverflow":
        assert standin["tokens"] > 10 * standin["samples"]


def validate(standin: dict, cache: Path, *prefix: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *prefix, "validate", str(PIPELINE), f"dataset.source.path={standin['path']}",
                           "model=cnn", *rehearsal.fitted(PIPELINE, standin["eligible"])],
                          env={**os.environ, "FEDPILOT_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
                               "HF_DATASETS_CACHE": str(cache / "hf")}, capture_output=True, text=True, timeout=300)


DIES_WRITING = """
import os, signal, sys
import numpy as np

def dying(path, array, *args, **kwargs):  # half of x.npy on disk, then kill -9
    with open(path, "wb") as file:
        file.write(np.lib.format.magic(1, 0) + bytes(64))
    os.kill(os.getpid(), signal.SIGKILL)

np.save = dying
from fedpilot.cli import main
sys.argv = ["fedpilot", *sys.argv[1:]]
main()
"""


def test_a_build_killed_while_writing_leaves_nothing_a_later_run_trusts(reduced, tmp_path):
    """The reduced rehearsal's FEMNIST stand-in built in a fresh cache, the build killed with SIGKILL halfway
    through writing its images; the next `validate` rebuilds it whole."""
    standin, cache = reduced["femnist"]["standin"], tmp_path / "cache"
    killed = validate(standin, cache, "-c", DIES_WRITING)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    entries = [p for p in (cache / "data").iterdir()]
    assert len(entries) == 1 and entries[0].name.endswith(".tmp")  # the half-written folder, under its temp name
    assert (entries[0] / "x.npy").is_file() and not (entries[0] / "meta.json").exists()

    again = validate(standin, cache, "-m", "fedpilot.cli")
    assert again.returncode == 0, again.stderr[-2000:]
    entries = [p for p in (cache / "data").iterdir()]
    assert len(entries) == 1 and not entries[0].name.startswith(".")  # rebuilt whole; the dead build's folder gone
    assert (entries[0] / "meta.json").is_file()
    assert np.load(entries[0] / "x.npy").shape == (standin["samples"], 1, 28, 28)


def tiny_spec() -> DatasetSpec:
    return DatasetSpec.from_dict({"source": {"kind": "synthetic", "n_clients": 4, "dim": 5, "classes": 3},
                                  "partition": {"kind": "natural"}})


def test_an_interrupted_build_removes_its_folder_and_abandoned_ones_are_removed(tmp_path, monkeypatch):
    spec = tiny_spec()

    def interrupted(path, array, *args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        patch.setattr(np, "save", interrupted)
        with pytest.raises(KeyboardInterrupt):
            build_federated_data(spec, seed=0, cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []  # Ctrl+C: nothing left behind
    key = fingerprint(spec, 0)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead, alive = tmp_path / f".{key}.{gone.pid}.tmp", tmp_path / f".{key}.{os.getppid()}.tmp"
    broken = tmp_path / key  # an entry folder without meta.json (not written by `save`)
    for folder in (dead, alive, broken):
        folder.mkdir()
        (folder / "x.npy").write_bytes(b"half")
    remove_abandoned(broken)
    assert sorted(p.name for p in tmp_path.iterdir()) == [alive.name]  # a live process may still be writing its own
    data = build_federated_data(spec, seed=0, cache_dir=tmp_path)
    assert data.n_clients == 4 and not data.cache_hit and (tmp_path / key / "meta.json").is_file()


def test_packing_every_clients_splits_at_once_matches_packing_each_one():
    rng, ids = np.random.default_rng(0), {"pad": 0, "unk": 1, "bos": 2, "eos": 3}
    for _ in range(200):
        lengths = rng.integers(0, 9, rng.integers(0, 12))
        samples = [list(rng.integers(4, 50, n)) for n in lengths]
        runs = np.concatenate([[0], np.sort(rng.integers(0, len(samples) + 1, rng.integers(0, 4))), [len(samples)]])
        seq_len = int(rng.integers(1, 6))
        flat = np.array([t for s in samples for t in s], dtype=np.int32)
        stream = stream_of(flat, lengths.astype(np.int64), ids, chunk=int(rng.integers(1, 5)))
        edges = np.concatenate([[0], np.cumsum(lengths + 2)])[runs]
        windows, counts = pack_runs(stream, edges, seq_len, ids["pad"], chunk=int(rng.integers(1, 5)))
        each = [pack_windows(samples[a:b], seq_len, ids, True) for a, b in zip(runs[:-1], runs[1:], strict=True)]
        assert counts.tolist() == [len(w) for w in each]
        assert np.array_equal(windows, np.concatenate(each))


def test_a_text_build_reports_tokenizing_packing_and_writing(reduced, tmp_path):
    standin = reduced["stackoverflow"]["standin"]
    spec = DatasetSpec.from_dict({"source": {"kind": "hf", "path": standin["path"], "feature": "tokens",
                                             "partition_column": "user_id"}, "task": "next_token",
                                  "text": {"tokenizer": "word", "vocab_size": 500, "seq_len": 20},
                                  "partition": {"kind": "natural", "min_size": 1}})
    steps: list[tuple[str, int, int]] = []
    with reporting(lambda what, done, total: steps.append((what, done, total))):
        data = build_federated_data(spec, seed=0, cache_dir=tmp_path)
    last = {what: (done, total) for what, done, total in steps}
    assert list(last) == ["loading", "building the vocabulary", "tokenizing", "packing", "writing"]
    assert all(done == total for done, total in last.values())
    assert last["tokenizing"][1] == standin["samples"] and last["packing"][1] == len(data.x)
    steps.clear()
    with reporting(lambda *step: steps.append(step)):
        assert build_federated_data(spec, seed=0, cache_dir=tmp_path).cache_hit
    assert steps == []  # a cache hit has nothing to report


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="RLIMIT_DATA and /proc: Linux")
def test_an_executor_trial_beyond_the_memory_available_fails_as_out_of_memory_instead_of_being_killed():
    before = resource.getrlimit(resource.RLIMIT_DATA)
    more_than_available = int(psutil.virtual_memory().available * 0.95)
    # untouched, so without the cap it would "succeed" (Linux overcommits) and only touching it would kill us
    fits, _ = timing.within_memory(lambda: torch.empty(more_than_available, dtype=torch.uint8), torch.device("cpu"))
    assert not fits
    assert resource.getrlimit(resource.RLIMIT_DATA) == before
    assert timing.within_memory(lambda: torch.ones(1000).sum().item(), torch.device("cpu")) == (True, 1000.0)


def test_timing_past_its_budget_drops_clear_losers_by_their_warm_up_and_stops_after_a_turn(monkeypatch):
    calls: list[str] = []
    cost = {"fast": 0.01, "slow": 0.2, "close": 0.012}

    def run(name: str) -> None:
        calls.append(name)
        time.sleep(cost[name])

    monkeypatch.setattr(timing, "TIMING_BUDGET_S", 0.0)
    choice, seconds, _ = timing.fastest(list(cost), run, torch.device("cpu"), repeats=3)
    assert calls == ["fast", "slow", "close", "fast", "close"]
    assert choice in ("fast", "close") and set(seconds) == set(cost) and seconds["slow"] >= 0.2


def test_the_evaluation_batch_search_stops_where_a_larger_batch_no_longer_pays(monkeypatch):
    """A per-sample cost that is flat past 64 (a CNN on the CPU): the search stops after 128 and keeps 64, instead
    of going on to 16384, whose activations would be the evaluation's peak memory."""
    from fedpilot.engine.accel import evaluate

    rates = {16: 5.0, 32: 3.0, 64: 2.0, **{b: 1.98 - b * 1e-6 for b in evaluate.FORWARD_BATCHES[3:]}}
    sizes: list[int] = []

    def best_time(run, device, repeats=3):
        sizes.clear()
        run()
        return rates[sizes[0]] * sum(sizes)

    monkeypatch.setattr(evaluate, "_forward_batch", {})
    monkeypatch.setattr(evaluate, "best_time", best_time)
    inputs = torch.zeros(20000, 1)
    evaluate.in_batches(torch.nn.Linear(1, 1), lambda x: sizes.append(len(x)) or x, inputs)
    assert evaluate._forward_batch[next(iter(evaluate._forward_batch))] == (64, float("inf"))
