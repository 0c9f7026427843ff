"""What a researcher sees: the MLflow UI in headless Chromium on finished pipelines (model-training view, run names
that say what differs, each stage's summary on the parent, the report artifact with its plots, the per-client table
as a table), the side-by-side report as a file, and the pieces they are made of.

Without Chromium and its driver the browser test skips on a developer machine and fails on CI (CI=true). Its
screenshots (the runs table, the parent run's page and its charts, a stage run's page and its per-client table, the
report in MLflow's artifact view and as files) go to $FEDPILOT_SCREENSHOTS when it names a folder, else stay in the
test's tmp_path.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pandas as pd
import pytest
from mlflow import MlflowClient

from fedpilot.client_effects import participating
from fedpilot.report import REPORT_ARTIFACT
from fedpilot.report.figures import change_figure, human_bytes, table_figure
from fedpilot.report.pipeline_page import summary_table
from fedpilot.report.runs import PipelineRun, Stage, labelled, load_run, primary_metric, short_keys
from fedpilot.tracking import local_artifact, table_order
from fedpilot.tuning import trial_name
from pipeline_fixtures import PLOTTED, cli, run_id_of, write_pipeline
from test_deploy import need
from test_mlflow_server import running_mlflow_server

STAGES = ("pretrain", "personalize", "finetune")
PLOTS = "return [...document.querySelectorAll('.js-plotly-plot')].filter(p => p.querySelector('.main-svg')).length"


def test_primary_metric_comes_from_what_a_stage_recorded():
    assert primary_metric(["test_acc_p10", "test_loss_weighted", "val_acc_p10"]) == "acc"
    assert primary_metric(["test_mse_p10", "test_mae_p10", "test_mse_mean"]) == "mae"  # no acc: the first name
    assert primary_metric(["shared_bytes"]) == "acc"


def test_report_table_sorts_by_each_column_and_sizes_read_as_bytes():
    table = pd.DataFrame({"name": ["a", "b", "c"], "finetune": [0.5, 1.0, 0.25]})
    menu = table_figure(table).layout.updatemenus[0].buttons
    by_label = {b.label: b.args[0]["cells.values"][0] for b in menu}
    assert by_label["client order"][0] == ["a", "b", "c"]
    assert by_label["finetune ↓"] == [["b", "a", "c"], ["1", "0.5", "0.25"]]
    assert by_label["finetune ↑"][0] == ["c", "a", "b"]
    assert [human_bytes(n) for n in (512, 1536, 5 * 2**20, 3 * 2**30)] == ["512 B", "1.5 KiB", "5.0 MiB", "3.0 GiB"]


def test_report_shows_each_stages_change_per_client_and_the_novel_and_selected_numbers_where_recorded():
    """The dot plot of a stage holds its participating clients' change against the stage before (novel rows left
    out); the stage table gains the novel clients, the gap and the selected models only where a stage recorded them."""
    table = pd.DataFrame({"client": [0, 1, 2, 3], "name": ["a", "b", "c", "n"], "test_acc": [0.5, 0.75, 1.0, 0.25],
                          "previous_test_acc": [0.25, 1.0, 1.0, 0.0], "novel": [False, False, False, True]})
    clients = participating(table)
    assert list(clients["name"]) == ["a", "b", "c"] and participating(table.drop(columns="novel")).equals(
        table.drop(columns="novel"))
    first = {"test_acc_mean": 0.5, "test_acc_p10": 0.25}
    last = {**first, "novel_test_acc_mean": 0.375, "novel_test_acc_p10": 0.125, "participation_gap_acc_mean": 0.125,
            "selected_test_acc_mean": 0.875, "selected_test_acc_p10": 0.5, "selected_personal_share": 0.25}
    stages = [Stage("pretrain", "s0", "miss", first, clients.drop(columns="previous_test_acc"), {}),
              Stage("finetune", "s1", "miss", last, clients, {})]
    run = PipelineRun("r", "small", "1", stages, "small")
    dots = change_figure([run]).data
    assert [v.type for v in dots] == ["scatter"] and list(dots[0].customdata) == [0.25, -0.25, 0.0]
    shown = summary_table([run]).set_index("stage")
    assert shown.loc["finetune", ["novel mean", "novel p10", "participation gap", "selected mean", "kept personal"]
                      ].tolist() == ["0.375", "0.125", "+0.125", "0.875", "25%"]
    assert shown.loc["pretrain", "novel mean"] == "" and list(shown.columns)[-1] == "peak memory"
    stages[1].metrics = first
    assert "novel mean" not in summary_table([run]) and change_figure([PipelineRun("r", "x", "1", stages[:1], "x")]) \
        is None


def test_names_and_table_columns_put_what_differs_first():
    keys = ["stages.1.params.lr_v", "stages.1.local.lr", "stages.2.local.lr"]
    assert short_keys(keys) == {"stages.1.params.lr_v": "lr_v", "stages.1.local.lr": "1.local.lr",
                                "stages.2.local.lr": "2.local.lr"}
    assert trial_name("quickstart", 3, {keys[0]: 0.012345, keys[1]: 0.5, keys[2]: 0.001},
                      ["pretrain", "personalize", "finetune"]) == \
        "quickstart trial 3: personalize.params.lr_v=0.0123 personalize.local.lr=0.5 finetune.local.lr=0.001"
    assert trial_name("quickstart", 3, {keys[0]: 0.5}) == "quickstart trial 3: stages.1.params.lr_v=0.5"  # no names
    runs = [PipelineRun(str(i), name, "1", [], "") for i, name in enumerate(
        ["small stages.1.local.lr=0.1", "small stages.2.local.lr=0.1", "small stages.2.local.lr=0.2 seed=1"])]
    assert [r.label for r in labelled(runs)] == ["1.local.lr=0.1", "2.local.lr=0.1", "2.local.lr=0.2 seed=1"]
    columns = ["client", "name", "train_samples", "val_samples", "test_samples", "val_acc", "val_loss", "test_acc",
               "test_loss", "previous_test_acc", "gate_density"]
    assert table_order(columns) == ["name", "test_acc", "test_loss", "previous_test_acc", "val_acc", "val_loss",
                                    "train_samples", "val_samples", "test_samples", "gate_density", "client"]


@contextmanager
def mlflow_ui(workdir: Path) -> Iterator[str]:
    """`mlflow server` on the working directory's store, stopped by its PID at the end."""
    with running_mlflow_server(workdir / "mlflow.db", workdir / "mlflow-ui.log") as url:
        yield url


@contextmanager
def chromium(profile: Path) -> Iterator:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = need("chromium", shutil.which("chromium") or shutil.which("chromium-browser"))
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1400,1000",
                 f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(need("chromium-driver", shutil.which("chromedriver"))))
    try:
        yield driver
    finally:
        driver.quit()


def shown(driver, page: str, ready, timeout: float = 60) -> str:
    """Open `page`, wait until `ready(body text)` holds, and return the body text."""
    driver.get(page)
    deadline = time.monotonic() + timeout
    while True:
        text = driver.find_element("tag name", "body").text
        if ready(text) or time.monotonic() > deadline:
            return text
        time.sleep(0.5)


def plots_in(driver, count: int, timeout: float = 60) -> int:
    """The plotly figures the current document has drawn, once there are `count` (or the time is up)."""
    deadline = time.monotonic() + timeout
    while driver.execute_script(PLOTS) < count and time.monotonic() < deadline:
        time.sleep(0.5)
    return driver.execute_script(PLOTS)


def screenshots(workdir: Path) -> Path:
    """Where the browser test saves its screenshots: $FEDPILOT_SCREENSHOTS (created), else the test's folder."""
    folder = Path(os.environ.get("FEDPILOT_SCREENSHOTS") or workdir)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def full_page(driver, path: Path, width: int = 1400) -> None:
    """A screenshot of the whole document, however long (the window grown to its height)."""
    height = driver.execute_script("return Math.max(document.body.scrollHeight, document.documentElement.scrollHeight)")
    driver.set_window_size(width, min(max(height, 1000), 8000))
    driver.save_screenshot(str(path))
    driver.set_window_size(width, 1000)


@pytest.mark.slow
def test_mlflow_ui_shows_model_training_named_runs_stage_summaries_and_the_report(workdir):
    shots = screenshots(workdir)
    path = write_pipeline(workdir, PLOTTED)
    outputs = [cli("run", str(path), f"stages.2.local.lr={lr}", "--no-progress") for lr in (0.01, 0.02)]
    assert all(code == 0 for code, _ in outputs), outputs
    run_ids = [run_id_of(output) for _, output in outputs]
    client = MlflowClient()
    parents = [client.get_run(r) for r in run_ids]
    experiment = parents[0].info.experiment_id
    assert client.get_experiment(experiment).tags["mlflow.experimentKind"] == "custom_model_development"
    names = [p.info.run_name for p in parents]
    assert names == ["small stages.2.local.lr=0.01", "small stages.2.local.lr=0.02"]
    for parent in parents:
        assert {f"{s}/test_acc_p10" for s in STAGES} <= set(parent.data.metrics)
        assert parent.data.metrics["finetune/test_acc_p10"] == parent.data.metrics["final_test_acc_p10"]
    reused = load_run(client, run_ids[1]).stages[0]  # pretrain from the first run's cache entry
    # its rounds' loss, from the run that trained it
    assert reused.cache == "hit" and len(reused.curves["train_loss"]) == 4
    lines = outputs[1][1].splitlines()
    browse = lines.index(next(line for line in lines if line.startswith("browse (")))
    assert lines[browse].endswith("ui --port 5000 first):")  # the page's URL alone on the next line, whole
    assert lines[browse + 1] == f"  http://127.0.0.1:5000/#/experiments/{experiment}/runs/{run_ids[1]}" \
                                "?workflowType=machine_learning"
    both = workdir / "both.html"
    code, output = cli("report", *run_ids, "--output", str(both))
    assert code == 0 and str(both) in output, output

    with mlflow_ui(workdir) as url, chromium(workdir / "chromium-profile") as driver:
        view = "?workflowType=machine_learning"  # what the links fedpilot prints carry
        runs_page = shown(driver, f"{url}/#/experiments/{experiment}{view}",
                          lambda text: all(n in text for n in names))
        driver.save_screenshot(str(shots / "experiment-runs.png"))
        assert all(n in runs_page for n in names), runs_page[:2000]
        assert "Run Name" in runs_page and "Judges" not in runs_page  # the runs table, not the GenAI overview

        page = f"{url}/#/experiments/{experiment}/runs/{run_ids[1]}"
        overview = shown(driver, f"{page}{view}", lambda text: "finetune/test_acc_p10" in text)
        driver.save_screenshot(str(shots / "parent-overview.png"))
        assert names[1] in overview, overview[:2000]

        def sections(text: str) -> set[str]:  # the chart sections of a run page: a title and its chart count
            return set(re.findall(r"^(\S+)\n\(\d+\)$", text, re.MULTILINE))

        metrics_page = shown(driver, f"{page}/model-metrics{view}", lambda text: set(STAGES) <= sections(text))
        driver.save_screenshot(str(shots / "parent-model-metrics.png"))
        assert set(STAGES) <= sections(metrics_page), metrics_page[:2000]  # a section per stage

        shown(driver, f"{page}/artifacts/report.html{view}", lambda text: "report.html" in text)
        frame = None
        deadline = time.monotonic() + 60
        while frame is None and time.monotonic() < deadline:
            frame = next(iter(driver.find_elements("tag name", "iframe")), None)
            time.sleep(0.5)
        assert frame is not None, driver.find_element("tag name", "body").text[:2000]
        driver.switch_to.frame(frame)
        assert plots_in(driver, 6) == 6  # CDF, before/after, change per stage, curves, footprints, the table
        report_text = driver.find_element("tag name", "body").text
        driver.switch_to.default_content()
        driver.save_screenshot(str(shots / "report-artifact.png"))
        assert "fedpilot report: small stages.2.local.lr=0.02" in report_text
        assert all(s in report_text for s in STAGES) and "better" in report_text and "worse" in report_text

        stage = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{run_ids[1]}' and "
                                                 "tags.`fedpilot.stage` = 'personalize'")[0]
        stage_page = f"{url}/#/experiments/{experiment}/runs/{stage.info.run_id}"
        def charts(text: str) -> int | None:  # the count of the stage page's one chart section (charts off the
            found = re.search(r"^Model metrics\n\((\d+)\)$", text, re.MULTILINE)  # screen are not drawn)
            return int(found[1]) if found else None

        stage_metrics = [k for k in stage.data.metrics if not k.startswith("system/")]
        stage_text = shown(driver, f"{stage_page}/model-metrics{view}", lambda text: charts(text) is not None)
        driver.save_screenshot(str(shots / "stage-model-metrics.png"))
        assert charts(stage_text) == len(stage_metrics) and "val_acc_mean" in stage_metrics, stage_text[:2000]
        table_page = shown(driver, f"{url}/#/experiments/{experiment}/runs/{stage.info.run_id}/artifacts/"
                                   f"clients.json{view}", lambda text: "View as table" in text and "test_acc" in text)
        driver.save_screenshot(str(shots / "stage-clients-table.png"))
        assert stage.info.run_name == f"personalize · {names[1]}"
        assert "View as table" in table_page and table_page.index("name") < table_page.index("test_acc")

        # the run's own, as a file
        driver.get(local_artifact(client.tracking_uri, run_ids[1], REPORT_ARTIFACT).as_uri())
        assert plots_in(driver, 6) == 6
        full_page(driver, shots / "report.png")

        driver.get(both.as_uri())
        assert plots_in(driver, 6) == 6
        side_by_side = driver.find_element("tag name", "body").text
        full_page(driver, shots / "report-side-by-side.png")
        assert f"fedpilot report: {names[0]} vs {names[1]}" in side_by_side
        assert re.search(r"^lr=0\.01 pretrain miss", side_by_side, re.MULTILINE), side_by_side[:2000]  # short labels
