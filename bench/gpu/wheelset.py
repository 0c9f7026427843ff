"""Which wheels a GPU node without internet lacks: read pip's resolution report of fedpilot's dependencies together
with the node's preinstalled packages, and keep what fedpilot's dependencies reach without passing through a package
the node already has. Standard library and `packaging` (vendored in pip) only, so it runs before anything is
installed.

    python bench/gpu/wheelset.py REPORT.json --needed NAME [NAME ...] --node NAME [NAME ...]

prints `name==version` of each kept package, one a line, sorted.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import deque
from pathlib import Path

try:
    from packaging.requirements import InvalidRequirement, Requirement
except ImportError:  # pip vendors it
    from pip._vendor.packaging.requirements import InvalidRequirement, Requirement

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from arguments import input_file  # noqa: E402  (standard library only)

PYTHON = "3.12"  # the node's Python


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def environment(extra: str) -> dict[str, str]:
    """The marker environment of the node: CPython 3.12 on Linux x86-64."""
    return {"python_version": PYTHON, "python_full_version": f"{PYTHON}.3", "implementation_name": "cpython",
            "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
            "platform_machine": "x86_64", "os_name": "posix", "extra": extra}


def graph(report: dict) -> tuple[dict[str, str], dict[str, list[Requirement]]]:
    """name -> version, and name -> its requirements, of every package in pip's `--report`."""
    versions, requires = {}, {}
    for item in report["install"]:
        meta = item["metadata"]
        name = canonical(meta["name"])
        versions[name] = meta["version"]
        requires[name] = [Requirement(text) for text in meta.get("requires_dist") or []]
    return versions, requires


def reach(start: list[str], requires: dict[str, list[Requirement]], stop: set[str]) -> set[str]:
    """Packages reachable from `start` (requirement strings, extras followed) that are in the resolution, not
    expanding past the names in `stop`."""
    found: set[str] = set()
    todo = deque((canonical(Requirement(s).name), frozenset(Requirement(s).extras)) for s in start)
    seen = set()
    while todo:
        name, extras = todo.popleft()
        if (name, extras) in seen or name not in requires or name in stop:
            continue
        seen.add((name, extras))
        found.add(name)
        for req in requires[name]:
            wanted = req.marker is None or any(req.marker.evaluate(environment(e)) for e in ("", *extras))
            if wanted:
                todo.append((canonical(req.name), frozenset(req.extras)))
    return found


def pip_report(text: str) -> dict:
    """An argparse type: the JSON report of `pip install --dry-run --report`."""
    try:
        report = json.loads(input_file(text).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise argparse.ArgumentTypeError(f"{text!r}: not a JSON file ({err})") from None
    if not isinstance(report, dict) or not isinstance(report.get("install"), list):
        raise argparse.ArgumentTypeError(f"{text!r}: not pip's --report (no `install` list)")
    return report


def requirement(text: str) -> str:
    """An argparse type: a requirement (`name`, `name[extra]`, `name>=1.0`)."""
    try:
        Requirement(text)
    except InvalidRequirement as err:
        raise argparse.ArgumentTypeError(f"{text!r}: not a requirement ({str(err).splitlines()[0]})") from None
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("report", type=pip_report, help="pip's --report JSON")
    parser.add_argument("--needed", type=requirement, nargs="+", required=True,
                        help="what fedpilot (and the check's tests) require")
    parser.add_argument("--node", type=requirement, nargs="+", required=True, help="what the node has installed")
    args = parser.parse_args()
    versions, requires = graph(args.report)
    needed = {canonical(Requirement(s).name) for s in args.needed}
    # the node's packages and what they reach, except through a package fedpilot requires itself: that one is
    # shipped at the resolved version, with its own dependencies (a node's older typer may not bring pydantic)
    node = reach(args.node, requires, needed - {canonical(Requirement(s).name) for s in args.node})
    kept = reach(args.needed, requires, node)
    missing = needed - set(versions)
    if missing:
        sys.exit(f"not in pip's resolution: {sorted(missing)}")
    for name in sorted(kept):
        print(f"{name}=={versions[name]}")


if __name__ == "__main__":
    main()
