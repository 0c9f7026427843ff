"""The rules a tuning study decides by, apart from running trials (tuning.py): where its first points lie
(`points`), when a trial is pruned (`pruner`), and when a range is extended beyond an edge its best value lies near
(`edges`). Optuna and numpy only: no torch, no MLflow."""
