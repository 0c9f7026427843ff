"""Schedules driven by an injected clock on SQLite and PostgreSQL: firings, exactly-once recording across
schedulers, coalescing of missed firings, pause/resume/remove, and cron errors."""

from __future__ import annotations

import json
import re
import threading
from datetime import datetime, timedelta, timezone

import optuna
import pytest
from apscheduler.triggers.cron import CronTrigger

from fedpilot.db import Firing, Job, connect, session_factory
from fedpilot.errors import UserError
from fedpilot.jobs.schedule import (
    add,
    fire,
    first_firings,
    latest_due,
    list_schedules,
    remove,
    serve,
    set_paused,
    tick,
)
from pipeline_fixtures import cli, write_pipeline
from test_jobs import TINY

SEARCH = {"space": {"stages.0.local.lr": {"type": "float", "low": 0.01, "high": 0.1}},
          "objective": {"metric": "val_acc_weighted"}, "trials": 3}
T0 = datetime(2030, 1, 1, tzinfo=timezone.utc)


def at(minutes: int) -> datetime:
    return T0 + timedelta(minutes=minutes)


@pytest.fixture
def searchable(tmp_path):
    return write_pipeline(tmp_path, {**TINY, "search": SEARCH}, "tuned.yaml")


def queued_searches(engine) -> list[tuple[int, str]]:
    with session_factory(engine)() as session:
        return [(j.trials, j.study) for j in session.query(Job).filter_by(kind="search").order_by(Job.id)]


def test_firings_targets_duplicates_and_coalescing(db_url, searchable):
    engine = connect(db_url)
    schedule = add(engine, searchable, [], "*/10 * * * *", trials=5, now=at(0))
    assert schedule.study == "tiny" and json.loads(schedule.spec)["search"]["study"] == "tiny"
    clock = [at(5)]
    assert serve(engine, now=lambda: clock[0], once=True) == []
    clock[0] = at(10)
    assert len(serve(engine, now=lambda: clock[0], once=True)) == 1
    assert serve(engine, now=lambda: clock[0], once=True) == []
    assert serve(connect(db_url), now=lambda: clock[0], once=True) == []  # a second scheduler, same instant
    assert fire(engine, schedule, at(10)) is None
    clock[0] = at(60)  # the scheduler was down from 00:10 to 01:00: one firing, for 01:00
    log: list[str] = []
    assert len(serve(engine, now=lambda: clock[0], once=True, log=log.append)) == 1
    assert log == ["schedule tiny fired: job 2, a search bringing study tiny to 10 trials"]
    assert queued_searches(engine) == [(5, "tiny"), (10, "tiny")]
    with session_factory(engine)() as session:
        assert [f.fire_time for f in session.query(Firing).order_by(Firing.id)] == [at(10), at(60)]
    assert list_schedules(engine, now=at(60))[0] | {"created_at": None} == {
        "name": "tiny", "pipeline": "tiny", "cron": "*/10 * * * *", "trials": 5, "study": "tiny", "to": "queue",
        "paused": False, "firings": 2, "next_fire_time": at(60).isoformat(), "created_at": None}


def test_two_schedulers_at_the_same_instant_record_one_firing(db_url, searchable):
    add(connect(db_url), searchable, [], "*/10 * * * *", trials=2, name="nightly", now=at(0))
    fired: list[list[int]] = []
    start = threading.Barrier(4)

    def scheduler() -> None:
        engine = connect(db_url)
        start.wait()
        fired.append(tick(engine, at(10)))

    threads = [threading.Thread(target=scheduler) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(map(len, fired)) == [0, 0, 0, 1]
    assert queued_searches(connect(db_url)) == [(2, "nightly")]


def test_pause_resume_and_remove(db_url, searchable):
    engine = connect(db_url)
    add(engine, searchable, [], "*/10 * * * *", trials=4, name="s", now=at(0))
    set_paused(engine, "s", True)
    assert tick(engine, at(30)) == [] and list_schedules(engine)[0]["paused"] is True
    set_paused(engine, "s", False, now=at(35))  # 00:10-00:30 passed while paused: never fired
    assert tick(engine, at(36)) == []
    assert len(tick(engine, at(40))) == 1 and queued_searches(engine) == [(4, "s")]
    remove(engine, "s")
    assert list_schedules(engine) == [] and tick(engine, at(120)) == []
    with pytest.raises(UserError, match="NAME='s': no such schedule"):
        remove(engine, "s")


def test_latest_due_bisects_long_outages():
    cron = CronTrigger.from_crontab("* * * * *", timezone="UTC")
    assert latest_due(cron, at(0), at(0)) is None
    assert latest_due(cron, at(0), at(0) + timedelta(seconds=59)) is None
    assert latest_due(cron, at(0), at(525600) + timedelta(seconds=30)) == at(525600)
    assert latest_due(cron, at(0), at(7)) == at(7)


@pytest.mark.parametrize("cron", ["61 * * * *", "not a cron"])
def test_bad_cron_is_a_spec_error_and_exit_2(cron, searchable, tmp_path):
    engine = connect(f"sqlite:///{tmp_path}/p.db")
    with pytest.raises(UserError, match=r"^--cron="):
        add(engine, searchable, [], cron, trials=1)
    code, output = cli("schedule", "add", str(searchable), "--cron", cron, "--trials", "1",
                       "--db", f"sqlite:///{tmp_path}/p.db")
    assert code == 2 and "--cron=" in output


def test_schedule_cli(searchable, tmp_path, monkeypatch):
    monkeypatch.setenv("FEDPILOT_CACHE", str(tmp_path / "cache"))  # `schedule add` builds the dataset to check it
    db = ["--db", f"sqlite:///{tmp_path}/p.db"]
    code, output = cli("schedule", "add", str(searchable), "--cron", "0 2 * * *", "--trials", "3", "--name", "nightly",
                       *db)
    assert code == 0 and "firing k brings study nightly to k x 3 trials" in output
    assert re.search(r"first firing 20\d\d-\d\d-\d\d 02:00 UTC: adds 3 trials \(the study has 0\)", output), output
    code, output = cli("schedule", "add", str(searchable), "--cron", "0 3 * * *", "--trials", "3", "--name", "nightly",
                       *db)
    assert code == 2 and "--name='nightly': a schedule with this name exists" in output
    code, output = cli("schedule", "add", str(write_pipeline(tmp_path, TINY, "plain.yaml")), "--cron", "0 2 * * *",
                       "--trials", "3", *db)
    assert code == 2 and "search=None" in output
    assert cli("schedule", "pause", "nightly", *db) == (0, "schedule nightly: paused\n")
    code, output = cli("schedule", "list", "--json", *db)
    assert code == 0 and [(r["name"], r["paused"], r["study"]) for r in json.loads(output)] == [("nightly", True,
                                                                                                 "nightly")]
    assert cli("schedule", "resume", "nightly", *db)[0] == 0
    code, output = cli("scheduler", "--once", *db)
    assert code == 0 and output.splitlines()[-1] == "queued jobs: none", output
    assert re.fullmatch(r"\S+ \S+Z scheduler started: 1 schedule \(0 paused\), next firing: nightly at \S+; "
                        r"looking every 30 s, once", output.splitlines()[0]), output
    assert cli("schedule", "remove", "nightly", *db)[0] == 0
    code, output = cli("schedule", "remove", "nightly", *db)
    assert code == 2 and "no such schedule" in output


def test_schedule_add_on_a_study_with_trials_says_its_first_firings_add_none(db_url, searchable):
    study = optuna.create_study(storage=db_url, study_name="tiny")
    for value in range(5):
        study.add_trial(optuna.trial.create_trial(value=float(value)))
    engine = connect(db_url)
    schedule = add(engine, searchable, [], "0 2 * * *", trials=3, now=at(0))
    assert first_firings(engine, schedule, now=at(0)) == (
        "first firing 2030-01-01 02:00 UTC: adds none, the study has 5 trials already; firing 2 is the first to "
        "add (1)")
    remove(engine, "tiny")
    assert first_firings(engine, add(engine, searchable, [], "0 2 * * *", trials=8, now=at(0)), now=at(0)) == \
        "first firing 2030-01-01 02:00 UTC: adds 3 trials (the study has 5)"
