"""What a comparison and a search compute from recorded numbers, and the tables that show it: the scores over seeds
and their paired differences with a baseline (scores), confidence intervals, Holm's adjustment and the seeds a
difference needs (intervals), each pipeline's verdict against the baseline and the tuned choice's optimism
(verdicts), a tuning study's summary (study), the labels of searched keys (keys) and the rows of the tables (table).

Plain numbers in, plain numbers (or rows of text cells) out, and beneath both `compare/` (which computes and records
them) and `report/` (which reads them back from comparison.json): it imports numpy, scipy, pandas and
`fedpilot.metric_names`, and never compare, report, torch, MLflow or Optuna (tests/test_architecture.py).
"""
