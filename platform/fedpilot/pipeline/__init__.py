"""Run a pipeline: every input check first (checks), then the stages in order (runner), reusing finished ones from
the stage cache (cache), reporting each (report), stopping cleanly on signals (signals), Lightning's progress bar
(progress). Import each name from the module that defines it: checks imports torch only where a check needs it, the
runner trains (torch, Lightning, MLflow); the package itself imports nothing."""
