"""What a recorded comparison tells in MLflow (issue 53): its run and each pipeline run carry a description
(markdown on the Overview page: what ran, the table), no metric compares the baseline with itself, and the
parameters are those that apply, as used, none of them null."""

from __future__ import annotations

from mlflow import MlflowClient

from fedpilot.compare.work import COMPARE_RUN_TAG, VARIANT_TAG
from fedpilot.tracking import NOTE_TAG
from pipeline_fixtures import cli, run_id_of
from test_compare_tuned import write_set


def test_a_recorded_comparison_describes_itself_and_logs_only_what_applies(workdir):
    code, output = cli("compare", write_set(workdir), "--tune", "2", "--untuned", "--storage",
                       f"sqlite:///{workdir}/studies.db")
    assert code == 0, output
    client, run_id = MlflowClient(), run_id_of(output)
    comparison = client.get_run(run_id)
    note = comparison.data.tags[NOTE_TAG]
    assert note.startswith("**pair**: 2 pipelines (`base`, `other`), each tuned first by an Optuna study of 2 "
                           "trials on the validation `val_acc_mean` of seed(s) [2]")
    table = output[output.index("per-client test accuracy of each"):output.index("\nbrowse")].strip()
    assert f"```\n{table}\n```" in note  # the table as the command printed it
    params = comparison.data.params
    assert params["tune.objective"] == "val_acc_mean" and params["tune.seeds"] == "[2]"  # as used, not None
    assert "None" not in params.values() and "null" not in params.values()
    metrics = comparison.data.metrics
    assert "other.test_acc_mean.diff_mean" in metrics and "other.untuned.test_acc_mean.diff_mean" in metrics
    assert not [k for k in metrics if k.startswith("base.") and ("diff" in k or k.endswith((".better", ".worse")))]
    assert "base.test_acc_mean.mean" in metrics

    experiment = comparison.info.experiment_id
    runs = client.search_runs([experiment], f"tags.`{COMPARE_RUN_TAG}` = '{run_id}' and "
                                            f"tags.`{VARIANT_TAG}` = 'tuned' and tags.`fedpilot.pipeline` = 'other'")
    parent = runs[0]
    described = parent.data.tags[NOTE_TAG]
    assert described.startswith("What ran:\n\n```\nother: digits data, 12 clients (dirichlet alpha=0.5")
    assert "| stage | cache | mean | p10 | min | better | worse |" in described
    stages = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    for run in [parent, *stages]:
        values = run.data.params
        assert values and "null" not in values.values(), run.info.run_name
    assert "dataset.partition.alpha" in parent.data.params  # a Dirichlet split: its own keys only
    assert not [k for k in parent.data.params if k.endswith(("classes_per_client", "schedule.gamma", "adapter_dim"))]
    assert "stages.1.params.lr_u" in parent.data.params  # tuned: set, so logged
    stage = stages[0].data.params
    assert stage["local.schedule.kind"] == "constant" and "local.schedule.gamma" not in stage  # another kind's key
