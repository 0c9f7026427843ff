"""What a researcher sees in a browser (issue 53), in headless Chromium: the quickstart's report (what ran, the test
samples per client, the dot plot of changes, the fan of the validation metric, the footprints in IEC units), a tuned
comparison's page, and `fedpilot dashboard`'s study list with each comparison's studies labelled.

Without Chromium and its driver it skips on a developer machine and fails on CI (CI=true). Its screenshots go to
$FEDPILOT_SCREENSHOTS when it names a folder (`FEDPILOT_SCREENSHOTS=docs/images` refreshes the docs' images), else
stay in the test's tmp_path."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from fedpilot.report import REPORT_ARTIFACT
from fedpilot.tracking import local_artifact
from pipeline_fixtures import cli, run_id_of, write_pipeline
from test_compare_tuned import BASE
from test_mlflow_pages import chromium, full_page, plots_in, screenshots
from test_mlflow_server import free_port

ROOT = Path(__file__).resolve().parents[1]
SECTION = ("const h = [...document.querySelectorAll('h2')].find(e => e.textContent === arguments[0]);"
           "h.scrollIntoView(); return h.textContent;")


def write_set(folder: Path) -> str:
    """A set `k4` of three pipelines whose names share its prefix: FedAvg (the baseline), FedAlt and FedSim."""
    for algorithm in ("fedavg", "fedalt", "fedsim"):
        spec = {**BASE, "name": f"k4-{algorithm}", "stages": [BASE["stages"][0], {**BASE["stages"][1],
                                                                                  "algorithm": algorithm}]}
        write_pipeline(folder, spec, f"{algorithm}.yaml")
    comparison = {"name": "k4", "seeds": 3, "pipelines": ["fedavg.yaml", "fedalt.yaml", "fedsim.yaml"],
                  "tune": {"trials": 3}}
    (folder / "k4.yaml").write_text(yaml.safe_dump(comparison))
    return str(folder / "k4.yaml")


def at_section(driver, heading: str, path: Path) -> None:
    """A screenshot of the window scrolled to the section `heading`."""
    assert driver.execute_script(SECTION, heading) == heading
    time.sleep(0.5)
    driver.save_screenshot(str(path))


def serving(url: str, proc: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    """Wait until `url` answers (or fail with the server's log)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            time.sleep(1)
    pytest.fail(f"{url} did not answer: {log.read_text()}")


@pytest.mark.slow
def test_the_quickstart_report_a_comparison_page_and_the_dashboard_in_a_browser(workdir):
    shots = screenshots(workdir)
    code, output = cli("run", str(ROOT / "pipelines" / "quickstart.yaml"), "--no-progress")
    assert code == 0, output
    report = local_artifact(MlflowClient().tracking_uri, run_id_of(output), REPORT_ARTIFACT)
    storage = f"sqlite:///{workdir}/studies.db"
    code, output = cli("compare", write_set(workdir), "--tune", "3", "--storage", storage)
    assert code == 0, output
    comparison = local_artifact(MlflowClient().tracking_uri, run_id_of(output), REPORT_ARTIFACT)

    with chromium(workdir / "chromium-profile") as driver:
        driver.get(report.as_uri())
        assert plots_in(driver, 6) == 6  # CDF, before/after, changes, curves, footprints, the table
        text = driver.find_element("tag name", "body").text
        driver.save_screenshot(str(shots / "quickstart-report.png"))
        assert "What ran" in text and "finetune     finetune" in text
        assert "Clients have 3 to 4 test samples (median 4)" in text and "steps of 1/4 = 0.25" in text
        at_section(driver, "Change per client by stage", shots / "quickstart-report-changes-curves.png")
        assert "validation accuracy over clients" in driver.find_element("tag name", "body").text
        at_section(driver, "Footprints", shots / "quickstart-report-footprints.png")
        assert "32 MiB" in driver.find_element("tag name", "body").text  # the bytes axis's IEC ticks

        driver.get(comparison.as_uri())
        assert plots_in(driver, 3) >= 3  # the forest plot, the studies' trials, (the bands when drawn)
        page = driver.find_element("tag name", "body").text
        full_page(driver, shots / "comparison-report.png")
        assert "fedavg (baseline)" in page and "names without the set's prefix k4-" in page
        assert "difference [adjusted 95% interval] pp" in page and "p10 over trials" in page

        log = workdir / "dashboard.log"
        url = f"http://127.0.0.1:{free_port()}"
        with log.open("w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "fedpilot.cli", "dashboard", "--storage", storage,
                                     "--port", url.rsplit(":", 1)[1]], stdout=out, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        try:
            serving(f"{url}/dashboard", proc, log)
            driver.get(f"{url}/dashboard")
            deadline = time.monotonic() + 60
            while "k4: k4-fedsim.tune." not in driver.find_element("tag name", "body").text:
                assert time.monotonic() < deadline, driver.find_element("tag name", "body").text
                time.sleep(0.5)
            listed = driver.find_element("tag name", "body").text
            driver.save_screenshot(str(shots / "optuna-dashboard.png"))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    assert "k4: k4-fedavg.tune." in listed  # each study labelled by the comparison that tuned it
    assert log.read_text().startswith(f"Optuna dashboard for {storage} on {url}/dashboard")
