"""bench/gpu/check.sh, the first command on a GPU node, run here on the CPU with reduced sizes (--quick) and the
running Python's packages, so that the script cannot rot before a GPU runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_check_script_writes_every_part_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "bench/gpu/check.sh"), str(out), "--device", "cpu", "--quick"],
                          env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout + done.stderr
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8, files  # what the device tool brings back
    summary = json.loads((out / "summary.json").read_text())
    assert summary["passed"] and summary["device"] == "cpu"
    assert [p["part"] for p in summary["parts"]] == ["device facts", "engine tests", "pipelines", "profile", "compare",
                                                    "scale"]
    assert summary["facts"]["fp32_matmul_tflops"] > 0 and summary["facts"]["device"] == "cpu"
    tests = (out / "tests.log").read_text()
    assert " passed" in tests and " failed" not in tests and "[exit 0]" in tests
    runs = (out / "runs.log").read_text()
    assert "per-client test accuracy" in runs and "device cpu" in runs and "tracking sqlite:" in runs
    profiled = (out / "compare.log").read_text()  # the round under torch.profiler, before compare.py's tables
    assert "20 clients/round" in profiled and "s wall" in profiled and "aten::" in profiled
    compare = json.loads((out / "compare.json").read_text())
    (table,) = compare["tables"]
    assert table["clients_per_round"] == 5 and table["rows"][0]["median_s"] > 0
    assert {"fp32", "bf16"} <= set(compare["gemm_gflops"])
    scale = json.loads((out / "scale.json").read_text())
    assert scale["by_size"]["200"]["median_s"] > 0 and "eval_s" in scale["by_size"]["200"]
    assert "| clients | s/round (median) |" in (out / "scale.log").read_text()


def test_without_wheels_it_takes_the_checkouts_venv_and_says_why_a_part_failed(tmp_path):
    """No --wheels and no $PYTHON: the checkout's .venv (where `make install` put one), else python3 on PATH; a part
    that fails shows the end of its output on screen, not only its exit code (here CUDA parts on a machine without
    one: the device facts' traceback, bench/scale.py's refusal of the device)."""
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA, where the CUDA parts fail")
    venv = ROOT / ".venv" / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    done = subprocess.run(["bash", str(ROOT / "bench/gpu/check.sh"), str(tmp_path / "out"), "--device", "cuda",
                           "--quick", "--parts", "scale"], env=env, capture_output=True, text=True, timeout=200)
    assert done.returncode == 1, done.stdout + done.stderr
    if venv.exists():
        assert f"using the packages of {venv}" in done.stdout
    assert "device facts: FAILED (exit code 1)" in done.stdout and "Error" in done.stdout
    assert "scale: FAILED (exit code 2)" in done.stdout and "CUDA device" in done.stdout
    assert f"(all of it: {tmp_path / 'out' / 'scale.log'})" in done.stdout
