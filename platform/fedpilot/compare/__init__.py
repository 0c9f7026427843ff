"""`fedpilot compare SET.yaml`: a named set of pipelines over N seeds, as one table and one MLflow run; with
`--tune N` (or a `tune:` block), every pipeline at its best first.

A set file names its pipelines (paths relative to the file), the baseline the others are compared with (default: the
first pipeline), the seeds, optionally overrides applied to every pipeline, and optionally how to tune them:

    name: digits-k2                       # the MLflow experiment every run of the comparison goes to
    baseline: digits-k2-baselines         # the `name` of one of the pipelines (default: the first)
    seeds: 3                              # seeds 0, 1, 2 (or a list)
    pipelines: [../digits-k2-baselines.yaml, ../digits-k2-ditto.yaml]
    tune: {trials: 8}                     # optional: objective, seeds, sampler, pruner, tune_budget, untuned, batch

Each pipeline runs once per seed with its `seed` set to it (a different partition and initialisation, the same for
every pipeline of that seed, so a shared pretraining stage is trained once per seed and reused from the stage
cache). The score of a run is its last stage's distribution of per-client test accuracy (metric_names.scores_of).

Tuned (compare.plan, compare.work): each pipeline, baseline included, gets one Optuna study of exactly N finished
trials over what its algorithms declare tunable in the stages after those every pipeline shares (or its own written
`search.space`), trial 0 the pipeline as written, the objective on the validation split of the tuning seeds only;
then its best configuration runs on the comparison's seeds, which exclude the tuning seeds. Nothing of the test
split is read until the table. The work is claimed unit by unit through named leases, so several processes (queue
workers, a Slurm array) share it, and a stopped or killed comparison picks up what is done when it runs again.

The modules: plan (the set file and every spec it stands for), work (who runs what), record (the statistics, the
tables and their MLflow records). The statistics and the tables themselves are `fedpilot.stats`, which the report
reads too.
"""
