"""What docs/architecture.md says of the code's shape, checked: who may import whom, one root for the errors a user
can fix and which layer raises which, nothing below the CLI printing, tag names owned by tracking.py, no function over
60 lines, and no link in the docs that leaves the repository."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from fedpilot import errors

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "platform" / "fedpilot"
MODULES = sorted(PACKAGE.rglob("*.py"))
MAX_FUNCTION_LINES = 60


def module_name(path: Path) -> str:
    return ".".join(["fedpilot", *path.relative_to(PACKAGE).with_suffix("").parts]).removesuffix(".__init__")


def imports(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every fedpilot import in a file, relative ones resolved."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "fedpilot":  # from fedpilot import metric_names
            found += [(f"fedpilot.{a.name}", []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fedpilot"):
            found.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.startswith("fedpilot")]
    return found


def under(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


IMPORT_RULES = [  # (whose imports, what they may import besides their own package)
    ("fedpilot.engine", ("fedpilot.models", "fedpilot.errors", "fedpilot.metric_names", "fedpilot.schema")),
    ("fedpilot.data", ("fedpilot.errors", "fedpilot.metric_names", "fedpilot.registry", "fedpilot.schema",
                       "fedpilot.settings")),
    ("fedpilot.models", ("fedpilot.errors", "fedpilot.registry")),
    ("fedpilot.stats", ("fedpilot.metric_names",)),
]


@pytest.mark.parametrize(("owner", "allowed"), IMPORT_RULES, ids=[rule[0] for rule in IMPORT_RULES])
def test_a_layer_imports_only_what_lies_below_it(owner, allowed):
    wrong = [(module_name(path), module) for path in MODULES if under(module_name(path), owner)
             for module, _ in imports(path) if not under(module, owner, *allowed)]
    assert not wrong, wrong


def external_imports(path: Path) -> set[str]:
    """The top-level packages other than fedpilot a file imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
    return found - {"fedpilot"}


def test_the_statistics_lie_beneath_compare_and_report_and_import_no_training_library():
    """fedpilot.stats is plain numbers in, plain numbers out: no torch, Lightning, MLflow or Optuna; and the report
    reads a comparison's statistics from it, never from compare/ (which imports the report to log it)."""
    for path in MODULES:
        name = module_name(path)
        if under(name, "fedpilot.stats"):
            assert not external_imports(path) & {"torch", "lightning", "mlflow", "optuna"}, name
        if under(name, "fedpilot.report"):
            assert not [m for m, _ in imports(path) if under(m, "fedpilot.compare")], name


def test_nothing_below_the_cli_imports_it_prints_or_exits():
    for path in MODULES:
        name = module_name(path)
        if under(name, "fedpilot.cli"):
            continue
        assert not [m for m, _ in imports(path) if under(m, "fedpilot.cli")], name
        calls = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)]
        shown = [ast.unparse(c.func) for c in calls if ast.unparse(c.func) in ("print", "sys.exit", "typer.Exit",
                                                                              "typer.echo", "exit")]
        assert not shown, (name, shown)


def test_only_the_stage_reaches_into_accel_and_only_for_the_choice_and_the_evaluator():
    for path in MODULES:
        name = module_name(path)
        if under(name, "fedpilot.engine.accel"):
            continue
        for module, names in imports(path):
            if under(module, "fedpilot.engine.accel"):
                assert name == "fedpilot.engine.stage" and module == "fedpilot.engine.accel", (name, module)
                assert set(names) <= {"ExecutorChoice", "Evaluator"}, (name, names)


def test_one_root_for_the_errors_a_user_can_fix_and_each_layer_raises_its_own():
    branches = (errors.SpecError, errors.SetupError, errors.RunError, errors.SearchError, errors.JobError,
                errors.DataError)
    assert all(issubclass(branch, errors.UserError) for branch in branches)
    for error in (errors.JobError, errors.NoSuchJob, errors.SubmitRefused, errors.NoSuchRun, errors.StoreUnavailable,
                  errors.DataUnavailable, errors.SearchError, errors.SetupError):
        assert not issubclass(error, errors.SpecError), error
    assert not issubclass(errors.StageFailed, errors.UserError)
    for path in MODULES:
        name = module_name(path)
        if under(name, "fedpilot.jobs", "fedpilot.report", "fedpilot.tuning", "fedpilot.settings",
                 "fedpilot.leases") or (under(name, "fedpilot.algorithms") and name != "fedpilot.algorithms"):
            raised = [ast.unparse(n.exc.func) for n in ast.walk(ast.parse(path.read_text()))
                      if isinstance(n, ast.Raise) and isinstance(n.exc, ast.Call)]
            assert "SpecError" not in raised or under(name, "fedpilot.algorithms"), name


def test_an_algorithms_module_raises_no_user_error():
    """An algorithm checks its options before its nn.Module exists (prepare_model): no module of an algorithm raises
    an error a user fixes."""
    for path in (PACKAGE / "algorithms").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(ast.unparse(b) in ("nn.Module", "torch.nn.Module")
                                                      for b in node.bases):
                raised = [ast.unparse(n.exc) for n in ast.walk(node) if isinstance(n, ast.Raise) and n.exc]
                assert not [r for r in raised if "SpecError" in r or "UserError" in r], (path.name, node.name)


def test_tracking_owns_every_tag_name():
    """Every `fedpilot.*` tag is named once, in tracking.py (its `*_TAG` constants): no other module spells one."""
    from fedpilot import tracking

    tags = {value for name, value in vars(tracking).items() if name.endswith("_TAG") and isinstance(value, str)
            and value.startswith("fedpilot.")}
    assert {"fedpilot.seed", "fedpilot.stage_index", "fedpilot.executor", "fedpilot.compare_run"} <= tags
    spelled = [(module_name(path), tag) for path in MODULES if path.name != "tracking.py"
               for tag in tags if f'"{tag}"' in path.read_text() or f"'{tag}'" in path.read_text()]
    assert not spelled, spelled


def test_no_function_is_longer_than_60_lines():
    long = [f"{module_name(path)}.{node.name}: {node.end_lineno - node.lineno + 1}" for path in MODULES
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, long


def test_no_link_in_the_docs_leaves_the_repository():
    pages = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "bench").glob("*.md")]
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)", page.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            resolved = (page.parent / target).resolve()
            assert resolved.is_relative_to(ROOT) and resolved.exists(), (page.name, target)
        assert "../shared" not in page.read_text(), page.name  # a clone has no shared/ beside it, linked or not
    assert "docs/architecture.md" in (ROOT / "README.md").read_text()
