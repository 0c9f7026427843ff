"""Pipeline YAML -> typed PipelineSpec, in three steps a reader can take one at a time:

- compose: the user's file read within limits, its defaults and overrides checked, Hydra's compose of configs/;
- pipeline_spec: the schema a composed pipeline is validated against (PipelineSpec and its parts);
- search_spec: a pipeline's `search:` block (space, objectives, sampler, pruner).

The names of recorded metrics that objectives choose from are fedpilot.metric_names'.
"""

from fedpilot.settings import configs_dir
from fedpilot.spec.compose import (
    MAX_FILE_BYTES,
    MAX_OVERRIDE_CHARS,
    MAX_OVERRIDES,
    MAX_YAML_DEPTH,
    MAX_YAML_NODES,
    check_overrides,
    compose_pipeline,
    config_groups,
    load_pipeline,
    load_pipeline_at_seeds,
    read_user_yaml,
)
from fedpilot.spec.pipeline_spec import (
    EvaluationSpec,
    ModelSpec,
    PersonalizationSpec,
    PipelineSpec,
    StageSpec,
    TrackingSpec,
    check_numbers,
    pipeline_seed,
    with_values,
    written_values,
)
from fedpilot.spec.search_spec import Objective, Param, PrunerSpec, SamplerSpec, SearchSpec

__all__ = [
    "MAX_FILE_BYTES", "MAX_OVERRIDES", "MAX_OVERRIDE_CHARS", "MAX_YAML_DEPTH", "MAX_YAML_NODES", "EvaluationSpec",
    "ModelSpec", "Objective", "Param", "PersonalizationSpec", "PipelineSpec", "PrunerSpec", "SamplerSpec",
    "SearchSpec", "StageSpec", "TrackingSpec", "check_numbers", "check_overrides", "compose_pipeline",
    "config_groups", "configs_dir", "load_pipeline", "load_pipeline_at_seeds", "pipeline_seed", "read_user_yaml",
    "with_values", "written_values",
]
