"""What a long command shows in a terminal and leaves in a log (issue 53): `fedpilot compare ... > log.txt` writes
plain lines, no carriage return, with the pipeline and trial counters and the time left; on a terminal (a
pseudo-terminal here) rich's progress display; before the first line, what the command is doing; and --help grouped
in panels, without `<bool>` beside a flag or literal backticks."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

from typer.testing import CliRunner

from fedpilot.cli import app
from fedpilot.cli.display import Standing, clock, duration
from fedpilot.compare.events import RunDone, RunStarted, StudyStarted, TrialDone, UnitsDone
from test_compare_tuned import write_set

WIDE = {"COLUMNS": "120", "TERMINAL_WIDTH": "120"}


def test_the_standing_counts_trials_and_runs_and_estimates_the_time_left_at_its_pace(monkeypatch):
    clock_now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock_now[0])
    standing = Standing(["base", "other"], trials={"base": 3, "other": 3}, tuning_seeds=2, objective="val_acc_mean",
                        maximize=True,
                        started=clock_now[0])
    standing.hear(UnitsDone(0, 4, ()))
    assert standing.time_left() == "time left: known after the first trial or run"
    standing.hear(StudyStarted("base", 0, 3, None))
    assert standing.now == "pipeline 1 of 2 (base): tuning, trial 1 of 3"
    clock_now[0] += 120  # one trial on two tuning seeds: two runs' worth in 2 min
    event = TrialDone("base", 0, 0.5)
    standing.hear(event)
    assert standing.best == {"base": 0.5} and standing.left() == (2 + 3) * 2 + 4
    assert standing.line(event) == ("  [pipeline 1 of 2 (base): trial 1 of 3 done, best val_acc_mean 0.5000; runs 0 "
                                    "of 4; 2:00 elapsed, about 14 min left]")
    standing.hear(TrialDone("base", 1, None))  # pruned: no value, the best stays
    standing.hear(TrialDone("base", 2, 0.25))
    assert standing.best == {"base": 0.5} and standing.now == "pipeline 1 of 2 (base): tuning, its trials done"
    standing.hear(RunStarted("base", 0, "tuned"))
    assert standing.now == "pipeline 1 of 2 (base): run on seed 0 (tuned)"
    standing.hear(RunDone("base", 0, "tuned", 0.9))
    assert standing.runs_done == 1 and standing.done_here == 7
    standing.hear(UnitsDone(1, 4, ("base", "other")))  # another process finished the other study
    assert standing.left() == 3
    assert [duration(s) for s in (20, 95, 3725)] == ["under a minute", "about 2 min", "about 1 h 02 min"]
    assert [clock(s) for s in (5, 95, 3725)] == ["0:05", "1:35", "1:02:05"]


def fedpilot(*args: str) -> list[str]:
    return [sys.executable, "-m", "fedpilot.cli", *args]


def environment(workdir: Path) -> dict[str, str]:
    return {**os.environ, **WIDE, "FEDPILOT_DB": f"sqlite:///{workdir}/studies.db", "PYTHONPATH": os.pathsep.join(
        sys.path)}


def test_compare_into_a_file_writes_plain_lines_with_counters_and_the_time_left(workdir):
    set_file = write_set(workdir)
    with (workdir / "log.txt").open("w") as log, (workdir / "err.txt").open("w") as err:
        proc = subprocess.run(fedpilot("compare", set_file, "--tune", "2", "--progress"), stdout=log,
                              stderr=err, env=environment(workdir), cwd=workdir, timeout=600)
    text, said = (workdir / "log.txt").read_text(), (workdir / "err.txt").read_text()
    assert proc.returncode == 0, text + said
    assert "\r" not in text and "\x1b" not in text and "\r" not in said  # --progress draws no bar into a file
    assert said.splitlines()[:3] == ["checking the set and its pipelines ...",
                                     "loading torch, Lightning, MLflow and Optuna ...",
                                     "checking 6 (pipeline, seed) pairs as a run would, building their federations ..."]
    standing = [line for line in text.splitlines() if line.startswith("  [pipeline ")]
    assert len(standing) == 2 * 2 + 2 * 2  # after each trial (2 studies x 2) and each run (2 pipelines x 2 seeds)
    assert re.fullmatch(r"  \[pipeline 1 of 2 \(base\): trial 1 of 2 done, best val_acc_mean 0\.\d{4}; runs 0 of 4; "
                        r"\d+:\d\d elapsed, (about \d+ min|under a minute) left\]", standing[0]), standing[0]
    assert standing[-1].startswith("  [pipeline 2 of 2 (other): run on seed 1 done; runs 4 of 4;")
    assert text.splitlines()[-1].startswith("run_id: ")


def test_compare_on_a_terminal_shows_a_rich_progress_display(workdir):
    """The same set in a pseudo-terminal of 120 columns, one trial more per study (the studies go on from 2)."""
    set_file = write_set(workdir)
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(fedpilot("compare", set_file, "--tune", "3", "--seeds", "1"), stdin=subprocess.DEVNULL,
                            stdout=child, stderr=child, env={**environment(workdir), "TERM": "xterm-256color"},
                            cwd=workdir)
    os.close(child)
    shown = b""
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    os.close(main)
    assert proc.wait(timeout=600) == 0, shown.decode(errors="replace")[-3000:]
    text = shown.decode(errors="replace")
    assert "\x1b[" in text and "━" in text  # the live display redraws in place: cursor moves, its bar
    assert "comparison pair" in text and "pipeline 2 of 2 (other): tuning" in text
    assert re.search(r"trial 3 of 3 done, best val_acc_mean 0\.\d{4}", text)
    assert re.search(r"(about \d+ min|under a minute) left", text) and "run_id: " in text


def test_help_is_grouped_in_panels_without_bool_types_or_backticks():
    runner = CliRunner()
    top = runner.invoke(app, ["--help"], env=WIDE).output
    for panel in ("Runs", "Comparisons and searches", "Jobs", "Data", "Scaffolding"):
        assert f"─ {panel} ─" in top, top
    assert "dashboard" in top and "`" not in top and "<bool>" not in top
    compare = runner.invoke(app, ["compare", "--help"], env=WIDE).output
    assert "<bool>" not in compare and "`" not in compare and "--tune" in compare
    assert len(compare.splitlines()) <= 40, compare


def test_dashboard_refuses_a_missing_database_and_a_bad_port_in_one_line(tmp_path):
    runner = CliRunner()
    missing = runner.invoke(app, ["dashboard", "--storage", f"sqlite:///{tmp_path}/none.db"])
    assert missing.exit_code == 2 and missing.output.startswith(f"error: --storage='sqlite:///{tmp_path}/none.db': "
                                                                "no such database: no study was made here yet")
    assert not (tmp_path / "none.db").exists()
    port = runner.invoke(app, ["dashboard", "--port", "0"])
    assert port.exit_code == 2 and port.output.startswith("error: --port=0:"), port.output
