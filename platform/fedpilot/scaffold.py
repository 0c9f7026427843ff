"""What `fedpilot new algorithm|model|source NAME` writes: a ready plugin package in a folder of its own: a pyproject
with the entry point, the module (a working starting point written against fedpilot.api), a pipeline that uses it, and
tests with fedpilot.testing's helpers. The templates are fedpilot/templates/**/*.tmpl (string.Template: `${...}`)."""

from __future__ import annotations

import re
from importlib.metadata import version
from pathlib import Path
from string import Template

from fedpilot.errors import SpecError
from fedpilot.settings import check_folder

TEMPLATES = Path(__file__).parent / "templates"
NAME = re.compile(r"^[a-z][a-z0-9_]{0,47}$")


GROUPS = {"algorithm": "fedpilot.algorithms", "model": "fedpilot.models", "source": "fedpilot.sources"}


def builtin_names(kind: str) -> list[str]:
    """The built-in names of `kind`, which a plugin may not take."""
    if kind == "algorithm":
        from fedpilot.algorithms import ALGORITHMS as registry
    elif kind == "model":
        from fedpilot.models.options import MODELS as registry
    else:
        from fedpilot.data.config import SOURCES as registry
    return list(registry.builtins)


def write_plugin(kind: str, name: str, into: Path) -> Path:
    """Write the plugin package `fedpilot-NAME` of `kind` under `into`; its folder. A SpecError for a name that is not
    a lowercase identifier or is a built-in's, a folder that exists, or `into` where fedpilot cannot write."""
    if not NAME.match(name):
        raise SpecError("NAME", name, "must be a lowercase Python identifier: a-z, then a-z, 0-9 or _ (<= 48)")
    if name in builtin_names(kind):
        raise SpecError("NAME", name, f"is a built-in {kind}'s name: a plugin needs a name of its own")
    values = {"name": name, "kind": kind, "group": GROUPS[kind], "package": f"fedpilot_{name}",
              "dist": f"fedpilot-{name.replace('_', '-')}", "cls": "".join(p.capitalize() for p in name.split("_")),
              "fedpilot_version": ".".join(version("fedpilot").split(".")[:2])}
    root = into / values["dist"]
    if root.exists():
        raise SpecError("--into", str(root), "already exists: choose another folder or name")
    check_folder("--into", str(into), into)
    files = {"pyproject.toml": "pyproject.toml", "README.md": "README.md",
             f"{values['package']}/__init__.py": f"{kind}/module.py", f"pipelines/{name}.yaml": f"{kind}/pipeline.yaml",
             f"tests/test_{name}.py": f"{kind}/test_module.py"}
    for relative, template in files.items():
        target = root / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(Template((TEMPLATES / f"{template}.tmpl").read_text()).substitute(values))
    return root
