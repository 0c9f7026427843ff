"""Run a pipeline: every input check first (checks), then the stages in order (runner), reusing finished ones from
the stage cache (cache), reporting each (report), stopping cleanly on signals (signals)."""

from fedpilot.pipeline.cache import code_fingerprint
from fedpilot.pipeline.checks import Prepared, check_devices, prepare
from fedpilot.pipeline.progress import quiet_lightning
from fedpilot.pipeline.runner import PipelineResult, PipelineRunner, StageOutcome
from fedpilot.pipeline.signals import Stopped

__all__ = ["PipelineResult", "PipelineRunner", "Prepared", "StageOutcome", "Stopped", "check_devices",
           "code_fingerprint", "prepare", "quiet_lightning"]
