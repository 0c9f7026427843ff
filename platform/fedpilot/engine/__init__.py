"""The federated engine: the stage LightningModule, its cohorts, the Executor that runs their local SGD, aggregation.

Read a round as stage -> cohort -> executor (the Executor ABC) -> sequential (the reference executor); engine/accel/
holds the fast executors behind the same Executor, and the core sees it through two names: ExecutorChoice (which
executor a stage runs, timed on its first round) and Evaluator (the per-client metrics, run the chosen executor's
way). Import each name from the module that defines it: protocol and
config (the algorithm contract and the stage's settings) are torch-free, so validating a pipeline stays cheap; the
package itself imports nothing.
"""
