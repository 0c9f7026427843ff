"""The fedpilot command: help, data describe (text and JSON), clear errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from fedpilot.cli import app

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def test_help_lists_commands():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0 and "data" in result.output


def test_data_describe_json_and_cache(tmp_path):
    args = ["data", "describe", str(ROOT / "pipelines" / "quickstart.yaml"), "--json", "--cache-dir", str(tmp_path)]
    first = json.loads(runner.invoke(app, args).stdout)
    second = json.loads(runner.invoke(app, args).stdout)
    assert first["clients"] == 100 and first["num_classes"] == 10 and not first["cache_hit"]
    assert second["cache_hit"] and second["fingerprint"] == first["fingerprint"]
    assert second["build_seconds"] < 1.0


def test_data_describe_text_with_override(tmp_path):
    result = runner.invoke(app, ["data", "describe", str(ROOT / "pipelines" / "quickstart.yaml"),
                                 "dataset.partition.clients=20", "--cache-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "clients 20" in result.stdout and "label skew" in result.stdout


def test_bad_value_exits_2_and_names_the_key(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "fedpilot.cli", "data", "describe",
                           str(ROOT / "pipelines" / "quickstart.yaml"), "dataset.partition.alpha=-1",
                           "--cache-dir", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "dataset.partition.alpha=-1" in proc.stderr
    assert not list(tmp_path.iterdir())


def test_missing_file_and_yaml_syntax_error(tmp_path):
    missing = runner.invoke(app, ["data", "describe", str(tmp_path / "nope.yaml")])
    assert missing.exit_code == 2 and "no such file" in missing.stderr
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: x\nstages: [\n")
    result = runner.invoke(app, ["data", "describe", str(broken)])
    assert result.exit_code == 2 and "not valid YAML" in result.stderr
