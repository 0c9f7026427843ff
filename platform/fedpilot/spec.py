"""Pipeline YAML -> composed config: Hydra compose of configs/ groups, the user's file and overrides.

Composition only reads YAML; nothing named in a user's file is imported or instantiated.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fedpilot.errors import SpecError


def configs_dir() -> Path:
    """The configs/ tree: $FEDPILOT_CONFIGS, the copy inside an installed wheel, or the checkout's."""
    if os.environ.get("FEDPILOT_CONFIGS"):
        return Path(os.environ["FEDPILOT_CONFIGS"]).resolve()
    packaged = Path(str(resources.files("fedpilot"))) / "configs"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[2] / "configs"


def compose_pipeline(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """The pipeline file composed with its `defaults` groups from configs/ and dotted `overrides`."""
    path = Path(path).resolve()
    if not path.is_file():
        raise SpecError("pipeline", str(path), "no such file")
    if path.suffix not in {".yaml", ".yml"}:
        raise SpecError("pipeline", str(path), "a pipeline is a .yaml file")
    _check_yaml(path)
    search = f"hydra.searchpath=[file://{configs_dir()}]"
    try:
        with initialize_config_dir(config_dir=str(path.parent), version_base="1.3"):
            cfg = compose(config_name=path.stem, overrides=[search, *overrides])
        composed = OmegaConf.to_container(cfg, resolve=True)
    except (HydraException, OmegaConfBaseException) as err:
        raise SpecError("pipeline", str(path), _first_line(err)) from None
    if not isinstance(composed, dict):
        raise SpecError("pipeline", str(path), "a pipeline is a mapping of keys to values")
    return composed


def _check_yaml(path: Path) -> None:
    """A clear error for a YAML syntax error, with the line and column."""
    try:
        OmegaConf.load(path)
    except Exception as err:  # yaml.YAMLError and OmegaConf's wrappers
        raise SpecError("pipeline", str(path), f"not valid YAML: {_first_line(err)}") from None


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
