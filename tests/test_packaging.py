"""The configs/ tree is found from a checkout and from an installed wheel."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_configs_found_in_checkout():
    from fedpilot.spec import configs_dir

    assert configs_dir() == ROOT / "configs"
    assert (configs_dir() / "dataset" / "digits.yaml").is_file()


def test_wheel_carries_configs_and_composes_a_pipeline(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(ROOT)], check=True)
    wheel = next((tmp_path / "dist").glob("fedpilot-*.whl"))
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    assert (site / "fedpilot" / "configs" / "dataset" / "digits.yaml").is_file()
    pipeline = tmp_path / "elsewhere" / "p.yaml"
    pipeline.parent.mkdir()
    pipeline.write_text("name: p\nseed: 0\ndefaults: [{dataset: digits}, _self_]\n")
    probe = (
        "import fedpilot, fedpilot.spec as s; "
        "print(fedpilot.__file__); print(s.configs_dir()); "
        f"print(s.compose_pipeline({str(pipeline)!r})['dataset']['source']['kind'])"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    env.pop("FEDPILOT_CONFIGS", None)
    out = subprocess.run([sys.executable, "-c", probe], cwd=pipeline.parent, env=env, check=True,
                         capture_output=True, text=True).stdout.split()
    assert out[0].startswith(str(site)) and out[1].startswith(str(site))
    assert out[2] == "digits"
