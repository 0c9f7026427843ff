"""A corpus of bad inputs: each ends with exit code 2, one `error: key=value: problem` line naming the bad key or
value, no traceback, and nothing created (no MLflow run, no dataset or stage cache entry or checkpoint, no job or
schedule row).

Every case runs the real CLI in-process in a fresh directory with its own stores; a few go through a real
subprocess (the alias bomb, with a time limit, and one ordinary case). Escape attempts point at a sibling
directory that must stay as it was. Two classes compare the stores (the cache, the MLflow store, the platform
database) file by file before and after: refusals made once the data is built, and paths from the environment or
a flag that cannot be created. The benchmark scripts' bad arguments run each script as `python SCRIPT` runs it, all
in one child process (REFUSALS): argparse's one error line and exit code 2 before any work.
"""

from __future__ import annotations

import copy
import json
import math
import os
import resource
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import datasets
import huggingface_hub.constants
import mlflow
import pytest
import yaml

from fedpilot.data.federated import Build
from fedpilot.errors import UserError
from fedpilot.spec import (
    MAX_FILE_BYTES,
    MAX_OVERRIDE_CHARS,
    MAX_OVERRIDES,
    MAX_YAML_DEPTH,
    MAX_YAML_NODES,
    compose_pipeline,
    configs_dir,
)
from pipeline_fixtures import cli

SECRET = "s3cr3t-value-of-the-environment"
BASE: dict[str, Any] = {
    "name": "bad-inputs",
    "defaults": [{"dataset": "digits"}, {"model": "mlp"}, "_self_"],
    "dataset": {"partition": {"kind": "iid", "clients": 8}},
    "model": {"hidden": [8]},
    "personalization": "output_layer",
    "tracking": {"system_metrics": False, "plots": False},
    "stages": [{"name": "pretrain", "algorithm": "fedavg", "rounds": 1, "clients_per_round": 4},
               {"name": "personalize", "algorithm": "fedalt", "rounds": 1, "clients_per_round": 4,
                "params": {"lr_v": 0.01}}],
}
SEARCH = {"space": {"stages.1.params.lr_v": {"type": "float", "low": 0.001, "high": 0.1, "log": True}},
          "objective": {"metric": "val_acc_weighted"}, "trials": 2}
SEARCHABLE = {**BASE, "search": SEARCH}
HF = {"kind": "hf", "path": "@DATA@/numbers.parquet", "feature": "x", "label": "y"}
ROOT = Path(__file__).resolve().parent.parent
BOMB = "".join([f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]\n" if i else "l0: &l0 [lol]\n"
                for i in range(10)]) + "name: *l9\n"


def edit(spec: dict[str, Any] = BASE, **changes: Any) -> dict[str, Any]:
    """A deep copy of `spec` with dotted keys (`stages__0__name` for stages.0.name) set; None deletes."""
    spec = copy.deepcopy(spec)
    for dotted, value in changes.items():
        *parents, leaf = [int(p) if p.isdigit() else p for p in dotted.split("__")]
        here = spec
        for part in parents:
            here = here[part]
        if value is None:
            del here[leaf]
        else:
            here[leaf] = value
    return spec


def text(**source: Any) -> dict[str, Any]:
    """`hf` with a word tokenizer for its text."""
    return edit(hf(**source), dataset__text={"tokenizer": "word", "seq_len": 6})


def hf(**source: Any) -> dict[str, Any]:
    """BASE on a Hugging Face source (the local files of the `hf_data` fixture)."""
    return edit(BASE, dataset={"source": {**HF, **source}, "partition": {"kind": "iid", "clients": 4}},
                stages__0__clients_per_round=2, stages__1__clients_per_round=2)


def case(name: str, expect: str, spec: dict[str, Any] | str | bytes | None = BASE, *args: str,
         command: tuple[str, ...] = ("validate",), escape: bool = False, file: str = "pipeline.yaml") -> Any:
    """One bad input: the pipeline `file` (None: none), the command and its arguments after the file, and what the
    error names. `@TMP@`, `@OUT@` (the sibling directory escapes aim at), `@DATA@` (local HF files) and
    `@ESCAPE@` (configs/dataset/../../<sibling>/evil) are filled in."""
    return pytest.param(spec, command, args, expect, escape, file, id=name)


def many(count: int) -> tuple[str, ...]:
    return tuple(f"seed={i}" for i in range(count))


CASES = [
    # ---- the file: YAML syntax, size, expansion, shape -----------------------------------------------------
    case("yaml-syntax", "not valid YAML: did not find expected ',' or ']'", "name: x\nstages: [\n  a: 1\n"),
    case("yaml-tab-indent", "not valid YAML", "name: x\nstages:\n\t- a\n"),
    case("yaml-duplicate-key", "found duplicate key name", "name: a\nname: b\n"),
    case("yaml-not-utf8", "not valid YAML", b"name: \x80\x81\n"),
    case("yaml-nested-too-deeply", f"nested more than {MAX_YAML_DEPTH} levels",
         "a: " + "[" * 3000 + "]" * 3000 + "\n"),  # past libyaml's own limit too (1000 in PyYAML 6.0.4)
    case("yaml-nested-past-the-limit", f"nested more than {MAX_YAML_DEPTH} levels",
         "a: " + "[" * (MAX_YAML_DEPTH + 1) + "]" * (MAX_YAML_DEPTH + 1) + "\n"),
    case("yaml-too-many-nodes", f"more than {MAX_YAML_NODES:,} nodes",
         "name: x\nbig: [" + "1, " * MAX_YAML_NODES + "1]\n"),
    case("empty-file", "the file is empty", ""),
    case("comments-only", "the file is empty", "# nothing here\n"),
    case("top-level-list", "not a list", "- name: x\n- seed: 1\n"),
    case("top-level-scalar", "not the single value 'just text'", "just text\n"),
    case("alias-bomb", f"more than {MAX_YAML_NODES:,} nodes", BOMB),
    case("alias-recursive", "refers to a node that contains it", "name: x\nloop: &a [1, *a]\n"),
    case("file-too-large", f"at most {MAX_FILE_BYTES:,}", "name: x\n" + "# padding\n" * (MAX_FILE_BYTES // 10)),
    case("not-a-yaml-file", "a pipeline is a .yaml file", BASE, file="pipeline.txt"),
    case("no-such-file", "no such file", None, "@TMP@/missing.yaml"),
    # ---- schema: types, unknown keys, ranges ---------------------------------------------------------------
    case("unknown-top-key", "stagse=", edit(stagse=[])),
    case("hydra-key-in-file", "hydra=", edit(hydra={"searchpath": ["file://@OUT@"]}), escape=True),
    case("seed-not-int", "seed='zero'", edit(seed="zero")),
    case("rounds-not-int", "stages.0.rounds='many'", edit(stages__0__rounds="many")),
    case("rounds-zero", "stages.0.rounds=0", BASE, "stages.0.rounds=0"),
    case("device-unknown", "device='tpu'", edit(device="tpu")),
    case("devices-zero", "devices=0", edit(devices=0)),
    case("evaluation-every-zero", "evaluation.every=0", edit(evaluation={"every": 0})),
    case("stages-empty", "stages=[]", edit(stages=[])),
    case("stage-unknown-key", "stages.0.roundz=3", BASE, "stages.0.roundz=3"),
    case("algorithm-unknown", "did you mean 'fedavg'", edit(stages__0__algorithm="fedavgg")),
    case("algorithm-param-unknown", "stages.1.params.tau_vv=2", BASE, "stages.1.params.tau_vv=2"),
    case("local-epochs-and-steps", "not both", BASE, "stages.0.local.epochs=1", "stages.0.local.steps=3"),
    case("lr-negative", "stages.0.local.lr=-1", BASE, "stages.0.local.lr=-1"),
    case("lr-schedule-kind", "stages.0.local.schedule.kind='cosine'", BASE, "stages.0.local.schedule.kind=cosine"),
    case("server-momentum-one", "stages.0.server.momentum=1", BASE, "stages.0.server.momentum=1"),
    case("override-index-out-of-range", "stages.7.rounds", BASE, "stages.7.rounds=3"),
    case("interpolation-missing-key", "stages.0.rounds='${nope.rounds}'", edit(stages__0__rounds="${nope.rounds}")),
    case("interpolation-cycle", "seed='${seed}'", edit(seed="${seed}")),
    case("interpolation-unclosed", "not a valid interpolation", edit(seed="${stages.0.rounds")),
    # ---- names: one pattern for everything that becomes a path or an identifier ----------------------------
    case("name-with-slash", "name='../evil'", edit(name="../evil"), escape=True),
    case("name-with-space", "name='my pipeline'", edit(name="my pipeline")),
    case("name-empty", "name=''", edit(name="")),
    case("name-too-long", "name='" + "n" * 129, edit(name="n" * 129)),
    case("stage-name-escape", "stages.0.name='x/../../../../@OUT@/evil'",
         edit(stages__0__name="x/../../../../@OUT@/evil"), command=("run",), escape=True),
    case("stage-name-override", "stages.1.name='../x'", BASE, "stages.1.name=../x", escape=True),
    case("stage-names-twice", "stages.1.name='pretrain'", edit(stages__1__name="pretrain")),
    case("study-escape", "search.study='../../@OUT@/study'", edit(SEARCHABLE, search__study="../../@OUT@/study"),
         escape=True),
    case("experiment-escape", "tracking.experiment='../evil'", edit(tracking={"experiment": "../evil"}),
         command=("run",), escape=True),
    case("search-study-option", "--study='a/b'", SEARCHABLE, "--study", "a/b", command=("search",), escape=True),
    case("schedule-name-option", "--name='../nightly'", SEARCHABLE, "--cron", "0 2 * * *", "--trials", "1",
         "--name", "../nightly", command=("schedule", "add"), escape=True),
    # ---- defaults: only files of configs/ groups -----------------------------------------------------------
    case("defaults-escape", "defaults.0.dataset='@ESCAPE@'", edit(defaults=[{"dataset": "@ESCAPE@"}, "_self_"]),
         escape=True),
    case("defaults-unknown-choice", "did you mean 'digits'", edit(defaults=[{"dataset": "digitz"}, "_self_"])),
    case("defaults-unknown-group", "defaults.1='optimizer'", edit(defaults=["_self_", {"optimizer": "adam"}])),
    case("defaults-not-a-list", "defaults='digits'", edit(defaults="digits")),
    case("defaults-config-path", "defaults.0='dataset/digits'", edit(defaults=["dataset/digits", "_self_"])),
    case("defaults-two-keys", "defaults.0=", edit(defaults=[{"dataset": "digits", "model": "mlp"}])),
    case("defaults-null-choice", "defaults.1.model=None", edit(defaults=[{"dataset": "digits"}, {"model": None}])),
    case("defaults-override-keyword", "defaults.0='override dataset'",
         edit(defaults=[{"override dataset": "digits"}])),
    case("defaults-resolver", "defaults.0.dataset='${oc.env:FEDPILOT_SECRET}'",
         edit(defaults=[{"dataset": "${oc.env:FEDPILOT_SECRET}"}])),
    case("group-override-escape", "dataset='@ESCAPE@'", BASE, "dataset=@ESCAPE@", escape=True),
    case("group-override-unknown", "model='mlpp'", BASE, "model=mlpp"),
    case("group-override-add-escape", "dataset='@ESCAPE@'", BASE, "+dataset=@ESCAPE@", escape=True),
    # ---- resolvers: none in the file or in overrides -------------------------------------------------------
    case("resolver-env", "seed='${oc.env:FEDPILOT_SECRET}'", edit(seed="${oc.env:FEDPILOT_SECRET}")),
    case("resolver-env-in-text", "name='run-${oc.env:FEDPILOT_SECRET}'", edit(name="run-${oc.env:FEDPILOT_SECRET}"),
         command=("run",)),
    case("resolver-nested", "'oc.select'", edit(seed="${oc.select:nope,${oc.env:FEDPILOT_SECRET}}")),
    case("resolver-in-key-path", "'oc.env'", edit(seed="${stages.${oc.env:FEDPILOT_SECRET}}")),
    case("resolver-hydra", "stages.0.name='${hydra:runtime.cwd}'", edit(stages__0__name="${hydra:runtime.cwd}")),
    case("resolver-unknown", "'foo'", edit(tracking={"uri": "${foo:bar}"})),
    case("resolver-in-list", "personalization.0=", edit(personalization=["${oc.env:FEDPILOT_SECRET}"])),
    case("resolver-override", "name='${oc.env:FEDPILOT_SECRET}'", BASE, "name=${oc.env:FEDPILOT_SECRET}"),
    case("resolver-override-nested", "stages.0.local.lr=", BASE, "stages.0.local={lr: ${oc.env:FEDPILOT_SECRET}}"),
    case("resolver-data-describe", "dataset.seed=", edit(dataset={"seed": "${oc.decode:'1'}"}),
         command=("data", "describe")),
    # ---- overrides: Hydra's grammar, one value, within limits ----------------------------------------------
    case("override-no-key", "override='=1'", BASE, "=1", command=("run",)),
    case("override-no-value", "override='key'", BASE, "key"),
    case("override-empty-key-part", "override='a..b=1'", BASE, "a..b=1"),
    case("override-equals-only", "override='='", BASE, "="),
    case("override-unbalanced", "override='stages=[1,2'", BASE, "stages=[1,2"),
    case("override-hydra-searchpath", "override='hydra.searchpath", BASE, "hydra.searchpath=[file://@OUT@]",
         escape=True),
    case("override-package", "override='dataset@x=digits'", BASE, "dataset@x=digits"),
    case("override-sweep", "override='seed=1,2'", BASE, "seed=1,2"),
    case("override-too-many", f"at most {MAX_OVERRIDES} overrides", BASE, *many(MAX_OVERRIDES + 1)),
    case("override-too-long", f"at most {MAX_OVERRIDE_CHARS:,}", BASE, "name=" + "x" * MAX_OVERRIDE_CHARS),
    # ---- numbers: finite everywhere ------------------------------------------------------------------------
    case("inf-local-lr", "stages.0.local.lr=inf", BASE, "stages.0.local.lr=inf", command=("run",)),
    case("inf-algorithm-param", "stages.1.params.lr_v=inf", BASE, "stages.1.params.lr_v=inf", command=("run",)),
    case("inf-string-weight-decay", "stages.0.local.weight_decay=inf",
         edit(stages__0__local={"weight_decay": "inf"})),
    case("nan-seed", "seed=nan", BASE, "seed=nan"),
    case("inf-server-lr", "stages.0.server.lr=-inf", BASE, "stages.0.server.lr=-inf"),
    case("inf-dataset-alpha", "dataset.partition.alpha=inf", BASE, "dataset.partition.kind=dirichlet",
         "dataset.partition.alpha=inf", command=("data", "describe")),
    case("inf-model-option", "model.hidden.0=inf", edit(model={"hidden": [float("inf")]})),
    case("inf-search-bound", "search.space.stages.1.params.lr_v.high=inf", edit(SEARCHABLE, search={
        **SEARCH, "space": {"stages.1.params.lr_v": {"type": "float", "low": 0.001, "high": float("inf")}}})),
    case("override-delete-list-entry", "override='~stages.0': an entry of a list cannot be deleted", BASE,
         "~stages.0"),
    case("override-delete-group-not-a-name", "dataset=2: not a config of configs/dataset", BASE, "~dataset=2"),
    case("override-group-choice-quoted", "model=", BASE, "model='mlpp'"),
    # ---- numbers the libraries take ------------------------------------------------------------------------
    case("seed-negative", "seed=-1: Input should be greater than or equal to 0", BASE, "seed=-1"),
    case("seed-past-32-bits", "seed=4294967296", BASE, "seed=4294967296", command=("run",)),
    case("seed-boolean", "seed=True: a number, not true or false", edit(seed=True)),
    case("rounds-boolean", "stages.0.rounds=True: a number, not true or false", edit(stages__0__rounds=True)),
    case("algorithm-param-boolean", "stages.1.params.lr_v=True: a number, not true or false", BASE,
         "stages.1.params.lr_v=true"),
    case("sampler-seed-negative", "search.sampler.seed=-1", SEARCHABLE, "search.sampler.seed=-1"),
    case("search-trials-past-sql", "search.trials=2147483648", SEARCHABLE, "search.trials=2147483648"),
    case("adam-beta-one", "stages.0.server.betas.1=1.0: Input should be less than 1", BASE,
         "stages.0.server.optimizer=adam", "stages.0.server.betas=[0.9,1.0]", command=("run",)),
    case("adam-beta-negative", "stages.0.server.betas.0=-0.5", BASE, "stages.0.server.betas=[-0.5,0.9]"),
    case("weight-decay-past-float32", "stages.0.local.weight_decay=1e+300: past float32's largest number", BASE,
         "stages.0.local.weight_decay=1e300", command=("run",)),
    case("lr-past-float32", "stages.0.local.lr=1e+39", BASE, "stages.0.local.lr=1e39", command=("run",)),
    case("algorithm-param-past-float32", "stages.1.params.lr_v=1e+300", BASE, "stages.1.params.lr_v=1e300",
         command=("run",)),
    case("epochs-past-float32", "stages.0.local.epochs=1e+300", BASE, "stages.0.local.epochs=1e300", command=("run",)),
    case("batch-size-past-int64", f"stages.0.local.batch_size={2**70}: past a 64-bit integer", BASE,
         f"stages.0.local.batch_size={2**70}", command=("run",)),
    case("algorithm-steps-past-int64", f"stages.1.params.tau_v={2**70}", BASE, f"stages.1.params.tau_v={2**70}",
         command=("run",)),
    case("model-size-past-int64", f"model.hidden.0={2**70}", BASE, f"model.hidden=[{2**70}]"),
    case("space-int-step-fraction", "whole numbers", edit(SEARCHABLE, search={
        **SEARCH, "space": {"stages.0.rounds": {"type": "int", "low": 1, "high": 3, "step": 0.5}}})),
    case("space-bound-past-float32", "past float32's largest number", edit(SEARCHABLE, search={
        **SEARCH, "space": {"stages.0.local.lr": {"type": "float", "low": 0.001, "high": 1e300}}})),
    # ---- the environment and paths (variables: tests/test_environment.py) ----------------------------------
    case("tracking-uri-scheme", "tracking.uri='bogus://x': not a tracking store MLflow can open",
         edit(tracking={"uri": "bogus://x"})),
    case("cache-dir-is-a-file", "--cache-dir='@TMP@/pipeline.yaml': not a folder fedpilot can write", BASE,
         "--cache-dir", "@TMP@/pipeline.yaml"),
    case("report-output-missing-folder", "--output='@TMP@/missing/report.html': no such folder", None, "abc", "-o",
         "@TMP@/missing/report.html", command=("report",)),
    case("run-result-file-missing-folder", "--result-file='@TMP@/missing/result.json': no such folder", BASE,
         "--result-file", "@TMP@/missing/result.json", command=("run",)),
    case("search-storage-no-driver", "--storage='mysql://u:***@localhost/x': its driver is not installed",
         SEARCHABLE, "--storage", "mysql://u:pw@localhost/x", command=("search",)),
    case("db-option-no-driver", "--db='mysql://u:***@h/x': its driver is not installed", None, "--db",
         "mysql://u:pw@h/x", command=("jobs",)),
    # ---- search blocks and the search command --------------------------------------------------------------
    case("space-unknown-key", "search.space.stages.0.local.lrr='lrr'", edit(SEARCHABLE, search={
        **SEARCH, "space": {"stages.0.local.lrr": {"type": "float", "low": 0.01, "high": 0.1}}})),
    case("space-low-above-high", "low=0.1 > high=0.01", edit(SEARCHABLE, search={
        **SEARCH, "space": {"stages.0.local.lr": {"type": "float", "low": 0.1, "high": 0.01}}})),
    case("space-log-low-zero", "log scale needs low > 0", edit(SEARCHABLE, search={
        **SEARCH, "space": {"stages.0.local.lr": {"type": "float", "low": 0, "high": 0.1, "log": True}}})),
    case("space-categorical-no-choices", "non-empty `choices`", edit(SEARCHABLE, search={
        **SEARCH, "space": {"stages.0.local.batch_size": {"type": "categorical"}}})),
    case("space-bound-invalid-pipeline", "search.space.stages.0.rounds=0", edit(SEARCHABLE, search={
        **SEARCH, "space": {"stages.0.rounds": {"type": "int", "low": 0, "high": 3}}})),
    case("objective-test-metric", "never optimize test metrics",
         edit(SEARCHABLE, search={**SEARCH, "objective": {"metric": "test_acc_mean"}})),
    case("objective-unknown-metric", "search.objective.metric='val_acc'",
         edit(SEARCHABLE, search={**SEARCH, "objective": {"metric": "val_acc"}})),
    case("objective-novel-without-novel-clients", "novel_* needs evaluation.novel_clients",
         edit(SEARCHABLE, search={**SEARCH, "objective": {"metric": "novel_val_acc_mean"}})),
    case("novel-clients-fraction-one", "evaluation.novel_clients=1.0", edit(evaluation={"novel_clients": 1.0})),
    case("novel-clients-zero", "evaluation.novel_clients=0", edit(evaluation={"novel_clients": 0})),
    case("novel-clients-word", "evaluation.novel_clients='some'", edit(evaluation={"novel_clients": "some"})),
    case("novel-clients-the-whole-federation", "evaluation.novel_clients=8: holds out 8 of the federation's 8",
         edit(evaluation={"novel_clients": 8})),
    case("novel-clients-leave-too-few-for-a-cohort", "stages.0.clients_per_round=4: only 3 of the federation's 8",
         edit(evaluation={"novel_clients": 5})),
    case("select-unknown", "evaluation.select='test'", edit(evaluation={"select": "test"})),
    case("objective-unknown-stage", "search.objective.0.stage='finetune'",
         edit(SEARCHABLE, search={**SEARCH, "objective": {"metric": "val_acc_mean", "stage": "finetune"}})),
    case("objective-stage-index", "search.objective.0.stage=5",
         edit(SEARCHABLE, search={**SEARCH, "objective": {"metric": "val_acc_mean", "stage": 5}})),
    case("search-trials-zero", "--trials=0", SEARCHABLE, "--trials", "0", command=("search",)),
    case("search-without-block", "search=None", BASE, command=("search",)),
    case("search-storage-url", "--storage='redis://localhost'", SEARCHABLE, "--storage", "redis://localhost",
         command=("search",)),
    case("search-data-too-small", "stages.0.clients_per_round=9", SEARCHABLE, "stages.0.clients_per_round=9",
         command=("search",)),
    # ---- schedules -----------------------------------------------------------------------------------------
    case("cron-never-fires", "--cron='0 0 30 2 *': never fires", SEARCHABLE, "--cron", "0 0 30 2 *", "--trials", "1",
         command=("schedule", "add")),
    case("cron-out-of-range", "--cron='61 * * * *'", SEARCHABLE, "--cron", "61 * * * *", "--trials", "1",
         command=("schedule", "add")),
    case("cron-wrong-fields", "--cron='* * *'", SEARCHABLE, "--cron", "* * *", "--trials", "1",
         command=("schedule", "add")),
    case("schedule-trials-zero", "--trials=0", SEARCHABLE, "--cron", "0 2 * * *", "--trials", "0",
         command=("schedule", "add")),
    case("schedule-without-search", "search=None", BASE, "--cron", "0 2 * * *", "--trials", "1",
         command=("schedule", "add")),
    case("schedule-data-too-small", "stages.1.clients_per_round=9", SEARCHABLE, "stages.1.clients_per_round=9",
         "--cron", "0 2 * * *", "--trials", "1", command=("schedule", "add")),
    # ---- datasets ------------------------------------------------------------------------------------------
    case("hf-relative-path-missing", "dataset.source.path='./data/missing.parquet'",
         hf(path="./data/missing.parquet")),
    case("hf-absolute-path-missing", "dataset.source.path='/nonexistent/fedpilot/data'",
         hf(path="/nonexistent/fedpilot/data")),
    case("hf-home-path-missing", "dataset.source.path='~/no/such/dataset'", hf(path="~/no/such/dataset")),
    case("hf-deep-path-missing", "dataset.source.path='data/train/part'", hf(path="data/train/part")),
    case("hf-suffix-missing", "dataset.source.path='train.csv'", hf(path="train.csv")),
    case("hf-glob-no-match", "no file matches this pattern", hf(path="@DATA@/*.nothing")),
    case("hf-hub-unreachable", "dataset.source.path='someone/no-such-dataset': the Hugging Face hub cannot be "
         "reached", hf(path="someone/no-such-dataset"), command=("run",)),
    case("hf-loading-script", "dataset.source.path='@DATA@/script': cannot load", hf(path="@DATA@/script")),
    case("hf-bad-config-name", "dataset.source.name='nope'", hf(path="@DATA@/folder", name="nope")),
    case("hf-bad-split", "dataset.source.split='test'", hf(path="@DATA@/folder", split="test")),
    case("hf-text-feature", "dataset.source.feature='text': holds text", hf(feature="text")),
    case("hf-ragged-feature", "dataset.source.feature='ragged'", hf(feature="ragged")),
    case("hf-no-feature-column", "dataset.source.feature='pixels': no such column", hf(feature="pixels")),
    case("hf-no-label-column", "dataset.source.label='labels'", hf(label="labels")),
    case("hf-no-partition-column", "dataset.source.partition_column='writer'", hf(partition_column="writer")),
    case("hf-text-data-describe", "dataset.source.feature='text'", hf(feature="text"), command=("data", "describe")),
    case("source-kind-typo", "did you mean 'digits'", BASE, "dataset.source.kind=digit"),
    case("partition-kind-typo", "did you mean 'dirichlet'", BASE, "dataset.partition.kind=dirichelt"),
    case("partition-more-clients-than-samples", "dataset.partition.clients=5000", BASE,
         "dataset.partition.clients=5000"),
    case("partition-natural-on-digits", "dataset.partition.kind='natural'", BASE, "dataset.partition.kind=natural"),
    case("partition-shards-cover", "dataset.partition.classes_per_client=2", BASE, "dataset.partition.kind=shards",
         "dataset.partition.clients=2"),
    case("split-no-train", "dataset.split.train=0", BASE, "dataset.split={train: 0, val: 0.5, test: 0.5}"),
    case("split-sum", "fractions must sum to 1", BASE, "dataset.split.train=0.9"),
    case("synthetic-no-clients", "dataset.source.n_clients=0", BASE, "dataset=synthetic",
         "dataset.source.n_clients=0"),
    # ---- data that cannot be trained on, numbers the data libraries refuse ---------------------------------
    case("hf-nan-regression-target", "dataset.source.label='nan_z': 1 value(s) are missing or not finite",
         edit(hf(label="nan_z"), dataset__task="regression")),
    case("hf-inf-vector-feature", "dataset.source.feature='inf_x': 2 value(s) are missing or not finite (null, inf "
         "or nan) in 1 sample(s)", hf(feature="inf_x")),
    case("hf-ragged-regression-target", "dataset.source.label='ragged': cannot be made one array of numbers",
         edit(hf(label="ragged"), dataset__task="regression")),
    case("split-no-test", "dataset.split.test=0.0: must be > 0", BASE, "dataset.split={train: 1.0, val: 0, test: 0}"),
    case("split-no-client-gets-test", "dataset.split.test=0.04: 0 of 179 clients get a test sample", BASE,
         "dataset.partition.clients=179", "dataset.split={train: 0.76, val: 0.2, test: 0.04}"),
    case("dataset-seed-negative", "dataset.seed=-1", edit(dataset__seed=-1)),
    case("synthetic-seed-too-large", "dataset.source.seed=4294967296: must be at most 4294967295", BASE,
         "dataset=synthetic", "+dataset.source.seed=4294967296"),
    case("synthetic-too-large-for-memory", "more than this machine's", BASE, "dataset=synthetic",
         "dataset.source.mean_size=30", "dataset.source.max_size=1000000000000"),
    case("synthetic-scale-huge", "dataset.source.beta=1e+300: must be at most 1e+30", BASE, "dataset=synthetic",
         "dataset.source.beta=1e300"),
    case("shards-more-than-samples", "dataset.partition.classes_per_client=1000000000", BASE,
         "dataset.partition.kind=shards", "dataset.partition.classes_per_client=1000000000"),
    case("dirichlet-alpha-huge", "dataset.partition.alpha=1e+308: must be at most 1e+300", BASE,
         "dataset.partition.kind=dirichlet", "dataset.partition.alpha=1e308"),
    case("text-seq-len-too-large-for-memory", "dataset.text.seq_len=100000000000", edit(
        text(feature="text"), dataset__text={"tokenizer": "word", "seq_len": 10**11})),
    case("vocab-size-past-32-bits", "dataset.text.vocab_size=4294967297: must be at most 4294967296", edit(
        text(feature="text"), dataset__text={"tokenizer": "word", "vocab_size": 2**32 + 1})),
    case("augment-std-zero", "dataset.augment.0.std.0=0", BASE, "+dataset.augment=[{kind: normalize, std: [0]}]"),
    case("augment-crop-padding-past-the-image", "dataset.augment.0.padding=8", BASE,
         "+dataset.augment=[{kind: random_crop, padding: 8}]"),
    case("search-val-objective-without-val", "search.objective.0.metric='val_acc_weighted': no client has a "
         "validation sample", SEARCHABLE, "dataset.split={train: 0.8, val: 0, test: 0.2}", command=("search",)),
    case("describe-seed-not-int", "seed='abc'", BASE, "seed=abc", command=("data", "describe")),
    # ---- models, personalization, cohorts ------------------------------------------------------------------
    case("model-unknown", "model.name='mlpp'", BASE, "model.name=mlpp"),
    case("model-unknown-option", "did you mean 'hidden'", BASE, "model.hiden=[3]"),
    case("model-reads-other-inputs", "model.name='transformer': does not read",
         edit(defaults=[{"dataset": "synthetic"}, "_self_"], dataset=None, model={"name": "transformer"})),
    case("model-n-heads", "model.n_heads=3", edit(text(feature="text"), model={
        "name": "text_classifier", "d_model": 10, "n_heads": 3})),
    # ---- tasks, text and augmentation ----------------------------------------------------------------------
    case("float-target-as-classes", "dataset.task='classification': the target column holds", hf(label="z")),
    case("regression-target-not-numbers", "dataset.source.label='text': task regression needs numbers",
         edit(hf(label="text"), dataset__task="regression")),
    case("regression-by-label-skew", "dataset.partition.kind='dirichlet'", edit(
        BASE, dataset={"task": "regression", "source": {"kind": "sklearn", "name": "diabetes"},
                       "partition": {"kind": "dirichlet", "clients": 4}})),
    case("next-token-without-text", "dataset.text=None", edit(hf(feature="text"), dataset__task="next_token")),
    case("next-token-on-numbers", "dataset.task='next_token': learns from text",
         edit(text(feature="x"), dataset__task="next_token")),
    case("unknown-tokenizer", "dataset.text.tokenizer='bpe'", edit(text(feature="text"), dataset__text={
        "tokenizer": "bpe"})),
    case("missing-tokenizer-file", "dataset.text.tokenizer='nowhere/tokenizer.json'", edit(
        text(feature="text"), dataset__text={"tokenizer": "nowhere/tokenizer.json"})),
    case("augment-non-image", "dataset.augment=['hflip']: augmentations apply to images",
         edit(defaults=[{"dataset": "synthetic"}, {"model": "mlp"}, "_self_"], dataset={"augment": ["hflip"]})),
    case("augment-unknown", "dataset.augment.0.kind='rotate'", BASE, "+dataset.augment=[rotate]"),
    case("objective-of-another-task", "search.objective.0.metric='val_acc_mean': not recorded by task regression",
         edit(SEARCHABLE, dataset={"task": "regression", "source": {"kind": "sklearn", "name": "diabetes"},
                                   "partition": {"kind": "iid", "clients": 8}},
              search={**SEARCH, "objective": {"metric": "val_acc_mean"}})),
    case("model-wrong-input-rank", "model.name='cnn': takes images",
         edit(defaults=[{"dataset": "synthetic"}, "_self_"], dataset=None, model={"name": "cnn"})),
    case("model-option-type", "model.hidden='abc'", BASE, "model.hidden=abc"),
    case("model-option-type-of-other-model", "model.hidden=[8]", BASE, "model=cnn"),
    case("personalization-bad-regex", "personalization='head.(('", edit(personalization=["head.(("])),
    case("personalization-stage-bad-regex", "stages.1.personalization='('", BASE,
         "stages.1.personalization=['(']"),
    case("personalization-matches-nothing", "matches no parameter name", edit(personalization=["nothing\\.here"])),
    case("personalization-unknown-preset", "did you mean", edit(personalization="output_layr")),
    case("cohort-above-federation", "stages.0.clients_per_round=9", BASE, "stages.0.clients_per_round=9",
         command=("run",)),
    # ---- what each stage's algorithm needs of the split ----------------------------------------------------
    case("personalized-algorithm-nothing-personal", "personalization='none': stage 'personalize' (fedalt) trains "
         "personal parameters", BASE, "personalization=none", command=("run",)),
    case("personalized-algorithm-nothing-shared", "personalization='all': stage 'personalize' (fedalt) sends shared "
         "parameters", BASE, "personalization=all"),
    case("stage-split-nothing-personal", "stages.1.personalization='none': stage 'personalize' (fedalt)",
         SEARCHABLE, "stages.1.personalization=none", command=("search",)),
    case("finetune-nothing-personal", "stage 'tune' (finetune) trains personal parameters", edit(
        personalization="none", stages=[*BASE["stages"][:1], {"name": "tune", "algorithm": "finetune"}])),
    case("layer-preset-whole-model", "in model 'logreg'", edit(model={"name": "logreg"}), command=("submit",)),
    case("algorithm-part-matches-nothing", "stages.1.algorithm='lg_fedavg': its own personal part",
         edit(model={"name": "logreg"}, stages__1__algorithm="lg_fedavg", stages__1__params={})),
    # ---- other commands ------------------------------------------------------------------------------------
    case("submit-inf", "stages.0.local.lr=inf", BASE, "stages.0.local.lr=inf", command=("submit",)),
    case("submit-resolver", "'oc.env'", edit(seed="${oc.env:FEDPILOT_SECRET}"), command=("submit",)),
    case("submit-bad-name", "name='a/b'", edit(name="a/b"), command=("submit",), escape=True),
    case("submit-cohort-above-federation", "stages.0.clients_per_round=9", BASE, "stages.0.clients_per_round=9",
         command=("submit",)),
    case("submit-search-trials-zero", "--trials=0", SEARCHABLE, "--search", "--trials", "0", command=("submit",)),
    case("submit-hf-text-feature", "dataset.source.feature='text'", hf(feature="text"), command=("submit",)),
    case("model-larger-than-memory", "more than this machine's", BASE, "model.hidden=[9007199254740993]",
         command=("run",)),  # validate passes it (the schema knows no sizes); run counts it on the meta device
    case("model-negative-size", "model.hidden.0=-1: Input should be greater than 0", BASE, "model.hidden=[-1]"),
    case("model-adapters-nowhere", "personalization='adapters': model 'logreg' has no place for adapters",
         edit(model={"name": "logreg"}, personalization="adapters")),
    case("model-lstm-no-layers", "model.n_layers=0: an LSTM encoder has at least one layer", edit(
        text(feature="text"), model={"name": "text_classifier", "encoder": "lstm", "n_layers": 0})),
    case("model-context-too-short", "model.context=3: the sequences have 6 tokens", edit(
        text(feature="text"), model={"name": "transformer", "context": 3}, dataset__task="next_token")),
    case("run-no-such-file", "no such file", None, "missing.yaml", command=("run",)),
    case("run-resume-unknown", "--resume='nope'", None, "--resume", "nope", command=("run",)),
    case("run-no-pipeline", "pipeline=None", None, command=("run",)),
    case("cancel-unknown-job", "JOB_ID=999", None, "999", command=("cancel",)),
    case("jobs-bad-db-url", "--db='nosuchdb://x'", None, "--db", "nosuchdb://x", command=("jobs",)),
    case("search-trials-option-past-sql", "--trials=2147483648", SEARCHABLE, "--trials", "2147483648",
         command=("search",)),
    case("search-heartbeat-zero", "--heartbeat-seconds=0", SEARCHABLE, "--heartbeat-seconds", "0",
         command=("search",)),
    case("search-parallel-huge", "--parallel=100000", SEARCHABLE, "--to", "queue", "--parallel", "100000",
         command=("search",)),
    case("submit-trials-past-sql", "--trials=2147483648", SEARCHABLE, "--search", "--trials", "2147483648",
         command=("submit",)),
    case("schedule-trials-past-sql", "--trials=2147483648", SEARCHABLE, "--cron", "0 2 * * *", "--trials",
         "2147483648", command=("schedule", "add")),
    case("jobs-show-id-past-sql", f"JOB_ID={2**70}", None, str(2**70), command=("jobs", "show")),
    case("cancel-id-zero", "JOB_ID=0", None, "0", command=("cancel",)),
    case("worker-grace-huge", "--grace-seconds=1e+30", None, "--exit-when-idle", "--grace-seconds", "1e30",
         command=("worker",)),
    case("describe-seed-negative", "seed=-1", BASE, "seed=-1", command=("data", "describe")),
    case("schedule-pause-unknown", "NAME='nightly'", None, "nightly", command=("schedule", "pause")),
]


@pytest.fixture(scope="module")
def hf_data(tmp_path_factory) -> Path:
    """Local Hugging Face files: numbers, text and ragged columns as parquet; a data folder; a folder with a
    loading script (which `datasets` no longer runs)."""
    root = tmp_path_factory.mktemp("hf-data")
    table = datasets.Dataset.from_dict({"x": [[float(i), 1.0] for i in range(40)], "y": [i % 2 for i in range(40)],
                                        "text": ["hello"] * 40, "ragged": [[1.0] * (1 + i % 3) for i in range(40)],
                                        "z": [i * 0.37 for i in range(40)],
                                        "nan_z": [math.nan if i == 3 else i * 0.37 for i in range(40)],
                                        "inf_x": [[math.inf, -math.inf] if i == 5 else [float(i), 1.0]
                                                  for i in range(40)]})
    table.to_parquet(str(root / "numbers.parquet"))
    (root / "folder").mkdir()
    table.to_parquet(str(root / "folder" / "train.parquet"))
    (root / "script").mkdir()
    (root / "script" / "script.py").write_text("import datasets\n")
    return root


@pytest.fixture
def place(tmp_path, tmp_path_factory, monkeypatch, hf_data) -> dict[str, Path]:
    """A fresh working directory with its own MLflow store, cache and platform database; a sibling directory
    escapes aim at (holding a valid dataset config, `evil.yaml`); the hub offline; a secret in the environment."""
    outside = tmp_path_factory.mktemp("outside")
    (outside / "evil.yaml").write_text("source: {kind: digits}\npartition: {kind: iid, clients: 8}\n")
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("FEDPILOT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FEDPILOT_DB", f"sqlite:///{tmp_path}/fedpilot.db")
    monkeypatch.setenv("FEDPILOT_SECRET", SECRET)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # for subprocesses; this process reads the constants below
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    mlflow.set_tracking_uri(uri)
    return {"tmp": tmp_path, "outside": outside, "data": hf_data}


def fill(text: str, place: dict[str, Path]) -> str:
    """The placeholders of a case filled in for this place."""
    escape = os.path.relpath(place["outside"] / "evil", configs_dir() / "dataset")
    return (text.replace("@TMP@", str(place["tmp"])).replace("@OUT@", str(place["outside"]))
            .replace("@DATA@", str(place["data"])).replace("@ESCAPE@", escape))


def write(spec: dict[str, Any] | str | bytes, place: dict[str, Path], file: str = "pipeline.yaml") -> Path:
    """The case's pipeline file in its working directory."""
    path = place["tmp"] / file
    if isinstance(spec, bytes):
        path.write_bytes(spec)
    else:
        path.write_text(fill(spec if isinstance(spec, str) else yaml.safe_dump(spec, sort_keys=False), place))
    return path


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def created(tmp: Path) -> list[str]:
    """What a bad input must not leave: MLflow runs, stage cache entries or checkpoints, job or schedule rows."""
    found = [str(p) for part in ("stages", "runs") for p in (tmp / "cache" / part).rglob("*") if p.is_file()]
    for db, tables in (("mlflow.db", ["runs"]), ("fedpilot.db", ["fedpilot_jobs", "fedpilot_schedules"])):
        if (tmp / db).exists():
            with sqlite3.connect(tmp / db) as con:
                known = {row[0] for row in con.execute("select name from sqlite_master where type='table'")}
                found += [f"{db}:{t}" for t in tables if t in known and con.execute(f"select count(*) from {t}").
                          fetchone()[0]]
    return found


def check_output(code: int, output: str, expect: str) -> None:
    assert code == 2, output
    assert expect in output, output
    assert "Traceback" not in output, output
    assert SECRET not in output, output
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, output


@pytest.mark.parametrize(("spec", "command", "args", "expect", "escape", "file"), CASES)
def test_bad_input_exits_2_naming_it_and_creates_nothing(place, spec, command, args, expect, escape, file):
    before, cached = snapshot(place["outside"]), snapshot(place["tmp"] / "cache")
    path = [str(write(spec, place, file))] if spec is not None else []
    code, output = cli(*command, *path, *(fill(a, place) for a in args))
    check_output(code, output, fill(expect, place))
    assert created(place["tmp"]) == []
    assert snapshot(place["tmp"] / "cache") == cached  # no dataset built into the cache either
    if escape:
        assert snapshot(place["outside"]) == before


def test_the_corpus_is_large_and_its_bases_are_valid(place):
    assert len(CASES) >= 80
    for spec in (BASE, SEARCHABLE, hf()):
        code, output = cli("validate", str(write(spec, place)))
        assert code == 0, output


def subprocess_cli(*args: str) -> tuple[int, str, float]:
    """(exit code, stdout + stderr, CPU seconds) of `python -m fedpilot.cli ARGS`, interpreter start-up included
    (CPU, not wall-clock, seconds: other processes on the machine do not count)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-m", "fedpilot.cli", *args], capture_output=True, text=True, timeout=300)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return proc.returncode, proc.stdout + proc.stderr, cpu


def test_alias_bomb_is_refused_by_the_real_entry_point_at_the_cost_of_an_ordinary_bad_override(place):
    path = write(BOMB, place)
    start = time.perf_counter()
    with pytest.raises(UserError, match="nodes"):
        compose_pipeline(path)
    assert time.perf_counter() - start < 1.0  # the check itself; the commands below mostly import torch
    code, output, ordinary = subprocess_cli("run", str(write(BASE, place, "base.yaml")), "=1")
    check_output(code, output, "override='=1'")
    code, output, bomb = subprocess_cli("run", str(path))
    check_output(code, output, f"more than {MAX_YAML_NODES:,} nodes")
    assert bomb < ordinary + 15, (bomb, ordinary)  # expanded, the bomb once cost 45 s and 775 MB before failing
    assert created(place["tmp"]) == []


def test_validate_and_submit_warn_when_the_data_cannot_be_reached_from_here(place):
    """A hub dataset on a machine without the hub: the spec is valid, the data checks wait for a machine that
    reaches the data (run refuses it: the corpus case hf-hub-unreachable)."""
    path = place["tmp"] / "hub.yaml"
    path.write_text(yaml.safe_dump(hf(path="someone/no-such-dataset")))
    code, output = cli("validate", str(path))
    assert code == 0 and "warning: dataset.source.path='someone/no-such-dataset'" in output and "ok:" in output
    code, output = cli("submit", str(path))
    assert code == 0 and "warning:" in output


# ---- refusals made once the data is built: the stores stay as they were ------------------------------------

NOVEL_ALL = edit(evaluation={"novel_clients": 8})
SEARCH_NOVEL_ALL = edit(SEARCHABLE, evaluation={"novel_clients": 8})
HOLDS_OUT_ALL = "evaluation.novel_clients=8: holds out 8 of the federation's 8 clients"
NOTHING_PERSONAL = "personalization='none': stage 'personalize' (fedalt) trains personal parameters"
NIGHTLY = ("--cron", "0 2 * * *", "--trials", "1")

AFTER_BUILD = [
    case("novel-every-client-run", HOLDS_OUT_ALL, NOVEL_ALL, command=("run",)),
    case("novel-every-client-search", HOLDS_OUT_ALL, SEARCH_NOVEL_ALL, command=("search",)),
    case("novel-every-client-search-queued", HOLDS_OUT_ALL, SEARCH_NOVEL_ALL, "--to", "queue", "--parallel", "2",
         command=("search",)),
    case("novel-every-client-submit", HOLDS_OUT_ALL, NOVEL_ALL, command=("submit",)),
    case("novel-every-client-schedule", HOLDS_OUT_ALL, SEARCH_NOVEL_ALL, *NIGHTLY, command=("schedule", "add")),
    case("novel-leave-too-few-for-a-cohort-run", "stages.0.clients_per_round=4: only 3 of the federation's 8",
         edit(evaluation={"novel_clients": 5}), command=("run",)),
    case("select-val-without-val-search", "search.objective.0.metric='val_acc_weighted': no client has a validation "
         "sample", edit(SEARCHABLE, evaluation={"select": "val"}), "dataset.split={train: 0.8, val: 0, test: 0.2}",
         command=("search",)),
    case("personalized-algorithm-nothing-personal-submit", NOTHING_PERSONAL, BASE, "personalization=none",
         command=("submit",)),
    case("personalized-algorithm-nothing-personal-schedule", NOTHING_PERSONAL, SEARCHABLE, "personalization=none",
         *NIGHTLY, command=("schedule", "add")),
    case("model-reads-other-inputs-run", "model.name='transformer': does not read", edit(model={"name": "transformer"}),
         command=("run",)),
    case("round-plan-past-memory-validate", "a round's batch plan", BASE, "stages.0.local.epochs=1e12"),
    case("model-past-memory-run", "more than this machine's", BASE, "model.hidden=[9007199254740993]",
         command=("run",)),  # counted after prepare, on the meta device
    case("search-several-devices", "devices=2", SEARCHABLE, "devices=2", command=("search",)),  # refused by Search
    case("submit-trials-without-search", "--trials=3: only search jobs have trials", BASE, "--trials", "3",
         command=("submit",)),
    case("submit-run-in-parallel", "--parallel=2: only a search or a comparison runs in parallel", BASE, "--parallel",
         "2", command=("submit",)),
]


@pytest.fixture
def builds(monkeypatch) -> list[Path]:
    """The cache entries datasets are built for in this test (Build.stage watched)."""
    built: list[Path] = []
    stage = Build.stage

    def watched(self: Build, folder: Path) -> Any:
        built.append(folder)
        return stage(self, folder)

    monkeypatch.setattr(Build, "stage", watched)
    return built


def stores(tmp: Path) -> dict[str, bytes]:
    """Every file of the cache, the MLflow store and the platform database, with its bytes."""
    return {name: data for name, data in snapshot(tmp).items()
            if name.split("/")[0] in ("cache", "mlflow.db", "mlruns", "mlartifacts", "fedpilot.db")}


@pytest.mark.parametrize(("spec", "command", "args", "expect", "escape", "file"), AFTER_BUILD)
def test_a_refusal_once_the_data_is_built_leaves_the_stores_as_they_were(place, builds, spec, command, args, expect,
                                                                         escape, file):
    path = str(write(spec, place, file))
    before = stores(place["tmp"])
    code, output = cli(*command, path, *args)
    check_output(code, output, expect)
    assert builds, "refused before the dataset was built: not a case of this class"
    assert stores(place["tmp"]) == before


def test_compare_refused_once_the_data_is_built_leaves_the_stores_as_they_were(place, builds):
    """The set's first pipeline passes (its dataset built), its second is refused: neither dataset stays."""
    write({**BASE, "name": "first"}, place, "first.yaml")
    write(NOVEL_ALL, place)
    comparison = write({"name": "held-out", "baseline": BASE["name"], "seeds": 1,
                        "pipelines": ["first.yaml", "pipeline.yaml"]}, place, "set.yaml")
    before = stores(place["tmp"])
    code, output = cli("compare", str(comparison))
    check_output(code, output, HOLDS_OUT_ALL)
    assert builds and stores(place["tmp"]) == before


# ---- paths from the environment or a flag that cannot be created --------------------------------------------

SQLITE, FOLDER = "sqlite:////proc/fedpilot/store.db", "/proc/fedpilot/store"  # nothing can be created under /proc
FILE, DIR, PIPE = "not a file fedpilot can write", "not a folder fedpilot can write", "pipeline.yaml"


def path_case(name: str, environment: dict[str, str], args: tuple[str, ...], expect: str) -> Any:
    return pytest.param(environment, args, expect, id=name)


def everywhere(variable: str, value: str, problem: str, *commands: tuple[str, ...]) -> list[Any]:
    """`variable`=`value` refused by each of `commands`, naming the variable, the value and the problem."""
    return [path_case(f"{variable}:{' '.join(args[:2])}", {variable: value}, args, f"{variable}='{value}': {problem}")
            for args in commands]


PATHS = [
    *everywhere("MLFLOW_TRACKING_URI", SQLITE, FILE, ("validate", PIPE), ("run", PIPE), ("search", PIPE),
                ("compare", "set.yaml"), ("report", "abc"), ("worker", "--exit-when-idle")),
    *everywhere("MLFLOW_TRACKING_URI", FOLDER, DIR, ("run", PIPE)),
    *everywhere("FEDPILOT_DB", SQLITE, FILE, ("jobs",), ("submit", PIPE), ("schedule", "add", PIPE, *NIGHTLY),
                ("search", PIPE)),
    *everywhere("FEDPILOT_CACHE", FOLDER, DIR, ("validate", PIPE), ("run", PIPE), ("data", "describe", PIPE)),
    *everywhere("FEDPILOT_CONFIGS", FOLDER, "no such folder", ("validate", PIPE)),
    path_case("--db", {}, ("cancel", "1", "--db", SQLITE), f"--db='{SQLITE}': {FILE}"),
    path_case("--storage", {}, ("search", PIPE, "--storage", SQLITE), f"--storage='{SQLITE}': {FILE}"),
    path_case("--cache-dir", {}, ("search", PIPE, "--cache-dir", FOLDER), f"--cache-dir='{FOLDER}': {DIR}"),
    path_case("--output", {}, ("report", "abc", "-o", "/proc/report.html"), f"--output='/proc/report.html': {FILE}"),
    path_case("--result-file", {}, ("run", PIPE, "--result-file", "/proc/result.json"),
              f"--result-file='/proc/result.json': {FILE}"),
    path_case("--into", {}, ("new", "algorithm", "mine", "--into", FOLDER), f"--into='{FOLDER}': {DIR}"),
]


@pytest.mark.parametrize(("environment", "args", "expect"), PATHS)
def test_a_path_that_cannot_be_created_is_named_before_any_work(place, monkeypatch, environment, args, expect):
    write(SEARCHABLE, place)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    before = stores(place["tmp"])
    code, output = cli(*args)
    check_output(code, output, expect)
    assert stores(place["tmp"]) == before and not Path(FOLDER).parent.exists()


# ---- the benchmark scripts: argparse's one-line error before any work ---------------------------------------

def bench_case(script: str, expect: str, *args: str) -> Any:
    return pytest.param(script, args, expect, id=f"{script}:{' '.join(args)}")


BENCH = [
    bench_case("rehearsal.py", "argument --fraction: '0': must be > 0 and <= 1", "--fraction", "0"),
    bench_case("rehearsal.py", "argument --fraction: '2': must be > 0 and <= 1", "--fraction", "2"),
    bench_case("rehearsal.py", "argument --users: '-5': must be >= 1", "--users", "-5"),
    bench_case("rehearsal.py", "argument --out: '/proc/fedpilot': not a folder fedpilot can write", "--out",
               "/proc/fedpilot"),
    bench_case("rehearsal.py", "argument --table: 'missing.json': no such file", "--table", "missing.json"),
    bench_case("rehearsal.py", "argument --femnist-model: invalid choice: 'transformer'", "--femnist-model",
               "transformer"),
    bench_case("compare.py", "argument --warmup: 7 must be below --rounds (7)", "--warmup", "7"),
    bench_case("compare.py", "argument --clients-per-round: 2000 is more than the 1000 clients", "--clients-per-round",
               "2000"),
    bench_case("compare.py", "argument --device: 'tpu': not a device", "--device", "tpu"),
    bench_case("compare.py", "argument --json: 'missing/out.json': no such folder", "--json", "missing/out.json"),
    bench_case("compare_cost.py", "argument --json: 'missing/out.json': no such folder", "--json", "missing/out.json"),
    bench_case("compare_cost.py", "argument --tracking-uri: 'sqlite:///mlflow.db': no such store", "abc",
               "--tracking-uri", "sqlite:///mlflow.db"),
    bench_case("engine_throughput.py", "argument --gemm-gflops: 'nan': must be > 0", "--gemm-gflops", "nan"),
    bench_case("first_step.py", "argument --clients: 'many' is not an integer", "--clients", "many"),
    bench_case("first_step.py", "argument --device: 'cuda:99': ", "--device", "cuda:99"),
    bench_case("scale.py", "argument --cohort: 5000 is more than the 1000 clients", "--cohort", "5000"),
    bench_case("gpu/profile_round.py", "argument --precision: invalid choice: '16-mixed'", "--device", "cpu",
               "--precision", "16-mixed"),
    bench_case("gpu/check.py", "argument out: '/proc/fedpilot': not a folder fedpilot can write", "/proc/fedpilot"),
    bench_case("gpu/check.py", "argument --minutes: '-1': must be > 0", "out", "--minutes", "-1"),
    bench_case("gpu/wheelset.py", "argument report: 'missing.json': no such file", "missing.json", "--needed", "a",
               "--node", "b"),
    bench_case("gpu/wheelset.py", "argument --needed: 'a b': not a requirement", "report.json", "--needed", "a b",
               "--node", "b"),
    bench_case("contenders/plain_torch.py", "argument --workload: '{\"clients\": -1}': not a workload",
               "--workload", '{"clients": -1}', "--out", "out.json"),
]


# Every case in one child process, each script run as `python SCRIPT ARGS` runs it (runpy, as __main__, in a folder
# of its own): its output, exit code, CPU seconds and the files its folder holds after it. One process, not one per
# case: a script's imports (torch, Lightning) were most of what its refusal cost.
REFUSALS = r"""
import contextlib, io, json, os, runpy, sys, time, traceback
from pathlib import Path
answers, path = {}, list(sys.path[1:])
for case in json.loads(sys.argv[1]):
    folder = Path(case["folder"])
    folder.mkdir()
    (folder / "report.json").write_text('{"install": []}')
    os.chdir(folder)
    sys.argv, sys.path[:] = [case["script"], *case["args"]], [os.path.dirname(case["script"]), *path]
    out, err, code, start = io.StringIO(), io.StringIO(), 0, time.process_time()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(case["script"], run_name="__main__")
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else 1
        except BaseException:
            code, _ = 1, err.write(traceback.format_exc())
    answers[case["id"]] = {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue(),
                           "cpu_s": time.process_time() - start, "files": sorted(p.name for p in folder.iterdir())}
print(json.dumps(answers))
"""


@pytest.fixture(scope="module")
def bench_refusals(tmp_path_factory) -> dict[str, dict[str, Any]]:
    """Each BENCH case's answer by its id (REFUSALS)."""
    root = tmp_path_factory.mktemp("bench")
    cases = [{"id": case.id, "script": str(ROOT / "bench" / case.values[0]), "args": list(case.values[1]),
              "folder": str(root / f"case{i}")} for i, case in enumerate(BENCH)]
    done = subprocess.run([sys.executable, "-c", REFUSALS, json.dumps(cases)], cwd=root, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize(("script", "args", "expect"), BENCH)
def test_a_benchmark_script_refuses_a_bad_argument_before_any_work(bench_refusals, request, script, args, expect):
    done = bench_refusals[request.node.callspec.id]
    errors = [line for line in done["stderr"].splitlines() if ": error: " in line]
    assert done["code"] == 2 and len(errors) == 1 and expect in errors[0], done["stdout"] + done["stderr"]
    assert "Traceback" not in done["stderr"] and done["stdout"] == ""
    assert done["cpu_s"] < 30  # imports, then the refusal
    assert done["files"] == ["report.json"]


@pytest.mark.parametrize("args", [("run", "--resume", "abc"), ("compare", "--resume", "abc"), ("report", "abc"),
                                  ("cancel", "3"), ("jobs", "show", "4"), ("schedule", "pause", "nightly"),
                                  ("schedule", "remove", "nightly")], ids=" ".join)
def test_a_lookup_in_a_store_that_does_not_exist_creates_none(args, tmp_path, monkeypatch):
    """A run, job or schedule looked up by name where there is no store yet: no such thing, and still no store."""
    monkeypatch.chdir(tmp_path)
    for variable in ("MLFLOW_TRACKING_URI", "FEDPILOT_DB", "FEDPILOT_CACHE"):
        monkeypatch.delenv(variable, raising=False)
    code, output = cli(*args)
    assert code == 2 and output.startswith("error: ") and "no such" in output and "Traceback" not in output, output
    assert list(tmp_path.iterdir()) == []


# ---- tuned comparisons, storages, queues and Slurm (issue 51): every file and table as it was ----------------

CLOSED = "postgresql://u:pw@127.0.0.1:1/none"  # a database server that is not there (nothing listens on port 1)
CLOSED_SHOWN = "postgresql://u:***@127.0.0.1:1/none"
FIRST = edit(BASE, name="first", stages__1__algorithm="fedavg", stages__1__params={})  # shares stage 0 with BASE
SET = {"name": "pair", "seeds": 1, "pipelines": ["first.yaml", "pipeline.yaml"]}
QUEUED = ("--tune", "1", "--to", "queue")  # what the folder of a `queued` case already holds: this comparison queued


def set_case(name: str, expect: str, changes: dict[str, Any] | None = None, *args: str, command: str = "compare",
             environment: dict[str, str] | None = None, queued: bool = False) -> Any:
    """A comparison's bad input: the set file SET with `changes` (None deletes a key), the command's arguments after
    it, the environment; `queued`: refused in a folder where the same comparison was queued already."""
    return pytest.param(changes or {}, command, args, environment or {}, expect, queued, id=name)


COMPARE_CASES = [
    # ---- the tune block and the options that set it --------------------------------------------------------
    set_case("tune-scalar-with-tune-option", "tune=8: a mapping of the tuning settings", {"tune": 8}, "--tune", "2"),
    set_case("tune-yes-with-untuned", "tune='yes': a mapping of the tuning settings", {"tune": "yes"}, "--untuned"),
    set_case("tune-list", "tune=[2]: a mapping", {"tune": [2]}),
    set_case("tune-null-with-untuned", "--untuned=True: runs the pipelines as written", {"tune": None}, "--untuned"),
    set_case("tune-option-text", "--tune='abc': input should be a valid integer", {}, "--tune", "abc"),
    set_case("tune-option-fraction", "--tune='1.5': input should be a valid integer", {}, "--tune", "1.5"),
    set_case("tune-option-zero", "--tune=0: must be from 1", {}, "--tune", "0"),
    set_case("tune-trials-past-sql", "tune.trials=2147483648", {"tune": {"trials": 2**31}}),
    set_case("tune-unknown-key", "tune.trails=3: unknown key", {"tune": {"trials": 1, "trails": 3}}),
    set_case("tune-objective-test", "tune.objective='test_acc_mean': tuning reads the validation split only",
             {"tune": {"trials": 1, "objective": "test_acc_mean"}}),
    set_case("tune-objective-novel-without-novel-clients", "tune.objective='novel_val_acc_mean': pipelines.0 "
             "(first.yaml): not recorded by task classification (novel_* needs evaluation.novel_clients)",
             {"tune": {"trials": 1, "objective": "novel_val_acc_mean"}}),
    set_case("tune-objective-val-without-val", "tune.objective='val_acc_mean': pipelines.0 (first.yaml): no client "
             "has a validation sample", {"tune": {"trials": 1}}, "dataset.split={train: 0.8, val: 0, test: 0.2}"),
    set_case("tune-seeds-overlap", "tune.seeds=[0]: overlap the comparison's seeds", {"tune": {"trials": 1,
                                                                                             "seeds": [0]}}),
    set_case("tune-seed-past-32-bits", "tune.seeds.0=4294967296", {"tune": {"trials": 1, "seeds": [2**32]}}),
    set_case("default-tuning-seed-past-32-bits", "seeds=[4294967295]: the studies tune on the seed after the "
             "largest by default, 4294967296", {"seeds": [2**32 - 1]}, "--tune", "1"),
    set_case("tune-sampler-unknown", "tune.sampler.kind='grid'", {"tune": {"trials": 1, "sampler": {"kind": "grid"}}}),
    set_case("tune-pruner-unknown", "tune.pruner.kind='fast'", {"tune": {"trials": 1, "pruner": {"kind": "fast"}}}),
    set_case("tune-budget-not-boolean", "tune.tune_budget=", {"tune": {"trials": 1, "tune_budget": "maybe"}}),
    # ---- storages and tracking stores: opened before anything is created -----------------------------------
    set_case("storage-closed", f"--storage='{CLOSED_SHOWN}': cannot connect to the database", {}, "--tune", "1",
             "--storage", CLOSED),
    set_case("fedpilot-db-closed", f"FEDPILOT_DB='{CLOSED_SHOWN}': cannot connect", {}, "--tune", "1",
             environment={"FEDPILOT_DB": CLOSED}),
    set_case("tracking-store-closed", "MLFLOW_TRACKING_URI='postgresql+psycopg://u:***@127.0.0.1:1/none': cannot "
             "connect", {}, environment={"MLFLOW_TRACKING_URI": "postgresql+psycopg://u:pw@127.0.0.1:1/none"}),
    set_case("storage-scheme-unknown", "--storage='redis://localhost'", {}, "--storage", "redis://localhost"),
    set_case("storage-no-driver", "--storage='mysql://u:***@localhost/x': its driver is not installed", {},
             "--storage", "mysql://u:pw@localhost/x"),
    set_case("search-storage-closed", f"--storage='{CLOSED_SHOWN}': cannot connect", {}, "--storage", CLOSED,
             command="search"),
    set_case("run-tracking-store-closed", "MLFLOW_TRACKING_URI='postgresql+psycopg://u:***@127.0.0.1:1/none'", {},
             command="run", environment={"MLFLOW_TRACKING_URI": "postgresql+psycopg://u:pw@127.0.0.1:1/none"}),
    set_case("submit-db-closed", f"FEDPILOT_DB='{CLOSED_SHOWN}': cannot connect", {}, command="submit",
             environment={"FEDPILOT_DB": CLOSED}),
    # ---- where the work goes: refused before a run is found or made, a queued comparison left as it was -------
    set_case("gpus-with-queue", "--gpus=1: a Slurm option: add --to slurm", {}, "--tune", "1", "--to", "queue",
             "--parallel", "2", "--gpus", "1", queued=True),
    set_case("slurm-environment-gpus", "FEDPILOT_SLURM.gpus='many'", {}, "--tune", "1", "--to", "slurm",
             environment={"FEDPILOT_SLURM": "gpus=many"}, queued=True),
    set_case("slurm-environment-unknown-key", "FEDPILOT_SLURM='gpu=1': not KEY=VALUE with a known key", {}, "--tune",
             "1", "--to", "slurm", environment={"FEDPILOT_SLURM": "gpu=1"}, queued=True),
    set_case("slurm-time-flag", "--time='forever'", {}, "--tune", "1", "--to", "slurm", "--time", "forever",
             queued=True),
    set_case("slurm-mem-flag", "--mem='lots'", {}, "--to", "slurm", "--mem", "lots"),
    set_case("slurm-controller-down", "--to='slurm': Slurm's", {}, "--tune", "1", "--to", "slurm",
             environment={"SLURM_CONF": "/nonexistent/slurm.conf"}, queued=True),
    set_case("storage-closed-when-queued", f"--storage='{CLOSED_SHOWN}'", {}, *QUEUED, "--storage", CLOSED,
             queued=True),
    set_case("tracking-closed-when-queued", "MLFLOW_TRACKING_URI='postgresql+psycopg://u:***@127.0.0.1:1/none'",
             {}, *QUEUED, environment={"MLFLOW_TRACKING_URI": "postgresql+psycopg://u:pw@127.0.0.1:1/none"},
             queued=True),
    set_case("parallel-without-to", "--parallel=2: starts workers elsewhere", {}, "--parallel", "2"),
    set_case("to-unknown", "--to='cloud': not a place jobs run", {}, "--to", "cloud"),
    set_case("parallel-huge", "--parallel=5000", {}, "--to", "queue", "--parallel", "5000"),
    set_case("heartbeat-zero", "--heartbeat-seconds=0", {}, "--heartbeat-seconds", "0"),
    set_case("resume-with-set-file", "--resume='abc': a resumed comparison uses its recorded plan", {}, "--resume",
             "abc"),
    set_case("cancel-not-a-number", "JOB_ID='abc': input should be a valid integer", None, "abc", command="cancel"),
    set_case("cancel-option-unknown", "No such option: --force (see fedpilot cancel --help)", None, "1", "--force",
             command="cancel"),
]


def write_set(place: dict[str, Path], changes: dict[str, Any]) -> Path:
    """The set SET (with `changes`) of FIRST and BASE in the case's folder."""
    write(FIRST, place, "first.yaml")
    write(BASE, place)
    return write({k: v for k, v in {**SET, **changes}.items() if v is not None}, place, "set.yaml")


@pytest.mark.parametrize(("changes", "command", "args", "environment", "expect", "queued"), COMPARE_CASES)
def test_a_refused_comparison_leaves_every_file_and_table_as_it_was(place, monkeypatch, changes, command, args,
                                                                     environment, expect, queued):
    comparison = write_set(place, changes)
    if queued:
        code, output = cli("compare", str(comparison), *QUEUED)
        assert code == 0, output
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    target = {"compare": [str(comparison)], "search": [str(write(SEARCHABLE, place, "searchable.yaml"))]
              if command == "search" else [], "run": [str(place["tmp"] / "pipeline.yaml")],
              "submit": [str(place["tmp"] / "pipeline.yaml")], "cancel": []}[command]
    before = stores(place["tmp"])
    code, output = cli(command, *target, *args)
    check_output(code, output, expect)
    assert stores(place["tmp"]) == before  # every file; the databases' tables byte for byte
    if queued:
        assert (place["tmp"] / "fedpilot.db").exists() and rows(place["tmp"] / "fedpilot.db", "fedpilot_jobs") == 1


def rows(database: Path, table: str) -> int:
    with sqlite3.connect(database) as con:
        return con.execute(f"select count(*) from {table}").fetchone()[0]


def test_a_budget_only_space_in_a_comparison_names_the_sets_tune_budget(place, monkeypatch):
    """A method whose only tunable is a budget (a plugin's, here fedalt made so): the comparison reads the set's
    `tune.tune_budget`, and its error says so (not the pipeline's search.tune_budget, which a comparison ignores)."""
    from fedpilot.algorithms import ALGORITHMS
    from fedpilot.api import Tunable

    monkeypatch.setattr(ALGORITHMS["fedalt"], "tunable", {"params.tau_v": Tunable(1, 10, budget=True)})
    comparison = write_set(place, {"tune": {"trials": 1}})
    before = stores(place["tmp"])
    code, output = cli("compare", str(comparison))
    check_output(code, output, "tune.tune_budget=False: pipelines.1 (pipeline.yaml): the searched stages declare "
                 "only budgets (local steps, model size) as tunable: set tune.tune_budget: true in the set")
    assert stores(place["tmp"]) == before
