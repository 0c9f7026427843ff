"""Where a study's first trials lie: trial 0 is the pipeline as written (a comparison's), then scrambled Sobol
points (scipy's, scrambled by a seed of the study's own, so two studies never try the same relative points), then
Optuna's TPE, a model of the trials so far. The start-up count grows with the tuned dimensions, not with the
study's trials: a study of N trials spends its first ones covering the space and the rest following the model."""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
from scipy.stats import qmc

from fedpilot.spec import Param

ORIGIN = "origin"  # a trial's user attribute: written | sobol | tpe | edge, which of the rules chose its values
WRITTEN, SOBOL, TPE, BEYOND_EDGE = "written", "sobol", "tpe", "edge"


def startup_count(dimensions: int, trials: int, written: bool) -> int:
    """Sobol points a study of `trials` trials starts with: the smallest power of two of at least twice its
    dimensions (a Sobol sequence is balanced in blocks of powers of two), within the trials left after trial 0."""
    wanted = 2 ** math.ceil(math.log2(2 * max(1, dimensions)))
    return max(0, min(trials - int(written), wanted))


def sobol_points(space: dict[str, Param], count: int, seed: int) -> list[dict[str, Any]]:
    """`count` points of a scrambled Sobol sequence over `space` (its scales: log where a dimension is)."""
    if count == 0:
        return []
    with warnings.catch_warnings():  # a count that is not a power of two: fewer points than a balanced block
        warnings.simplefilter("ignore", UserWarning)
        unit = qmc.Sobol(len(space), scramble=True, seed=np.random.default_rng(seed)).random(count)
    return [{key: value_at(param, float(u)) for (key, param), u in zip(space.items(), row, strict=True)}
            for row in unit]


def value_at(param: Param, u: float) -> Any:
    """The value at fraction `u` in [0, 1) of a dimension, on its scale (a step or an int rounds down)."""
    if param.type == "categorical":
        return param.choices[min(int(u * len(param.choices)), len(param.choices) - 1)]
    step = param.step or (1 if param.type == "int" else None)
    high = param.high + step if param.type == "int" else param.high  # every whole number gets an equal share
    if param.log:
        value = math.exp(math.log(param.low) + u * (math.log(high) - math.log(param.low)))
    else:
        value = param.low + u * (high - param.low)
    if step:  # onto the dimension's grid
        value = min(param.high, param.low + step * math.floor((value - param.low) / step + 1e-9))
    return int(value) if param.type == "int" else float(value)


def position(param: Param, value: float) -> float:
    """Where `value` lies in a numeric dimension, as a fraction of it on its scale (0 at low, 1 at high)."""
    if param.high == param.low:
        return 0.5
    if param.log:
        return (math.log(value) - math.log(param.low)) / (math.log(param.high) - math.log(param.low))
    return (value - param.low) / (param.high - param.low)
