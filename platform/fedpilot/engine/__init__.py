"""The vectorized federated engine: cohorts, local SGD executors, aggregation, the stage LightningModule."""

from fedpilot.engine.aggregate import WeightedMean
from fedpilot.engine.cohort import Cohort, Local, Upload
from fedpilot.engine.config import LocalConfig, LrSchedule, ServerConfig, StageConfig
from fedpilot.engine.metrics import distribution
from fedpilot.engine.stage import FederatedStage, carry_bank

__all__ = ["Cohort", "FederatedStage", "Local", "LocalConfig", "LrSchedule", "ServerConfig", "StageConfig",
           "Upload", "WeightedMean", "carry_bank", "distribution"]
