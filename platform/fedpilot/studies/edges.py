"""Ranges that follow a choice off their edge. A study whose best value lies in the outer tenth of a range (on its
scale) spends a bounded number of further trials beyond that edge, the other values at the best trial's; a choice
still in the outer tenth of the range after that (or of a range that cannot grow: a linear or categorical one, or
where the next value is not a valid pipeline) is flagged, in the table and the report."""

from __future__ import annotations

import math
from typing import Any

from fedpilot.spec import Param
from fedpilot.studies.points import position

EDGE = 0.1  # the outer tenth of a range, on its scale
GROWTH = 0.25  # a range grows beyond an edge by a quarter of its width on its scale
EDGES = "edges"  # a study's user attribute: per key the side it grew on and its new low and high


def edge_of(param: Param, value: Any) -> str | None:
    """`low` or `high` where `value` lies in the outer tenth of a numeric dimension, else None."""
    if param.type == "categorical" or param.high == param.low:
        return None
    where = position(param, value)
    return "low" if where < EDGE else "high" if where > 1 - EDGE else None


def grown(param: Param, side: str, trials: int) -> tuple[Param, list[Any]]:
    """A log-scale range grown beyond `side` by GROWTH of its width, and `trials` values evenly spread (on the log
    scale) over what it gained, nearest the old edge first; an int range's values rounded and distinct."""
    width = (math.log(param.high) - math.log(param.low)) * GROWTH
    edge, sign = (param.high, 1) if side == "high" else (param.low, -1)
    values = [math.exp(math.log(edge) + sign * width * k / trials) for k in range(1, trials + 1)]
    if param.type == "int":
        values = list(dict.fromkeys(max(1, round(v)) for v in values if max(1, round(v)) != edge))
    end = values[-1] if values else edge
    wider = param.model_copy(update={"high": end} if side == "high" else {"low": end})
    return wider, values


def extensible(param: Param) -> bool:
    """Whether a range can grow beyond its edges: a numeric one on a log scale (step sizes and weights)."""
    return param.type != "categorical" and param.log and param.step is None


def with_grown(space: dict[str, Param], grown_ranges: dict[str, dict[str, Any]]) -> dict[str, Param]:
    """`space` with the ranges a study grew (its EDGES attribute)."""
    return {key: param.model_copy(update={k: grown_ranges[key][k] for k in ("low", "high")})
            if key in grown_ranges else param for key, param in space.items()}


def flags(space: dict[str, Param], chosen: dict[str, Any]) -> dict[str, str]:
    """Per chosen value in the outer tenth of its (final) range, the side: what the table flags."""
    return {key: side for key, param in space.items() if key in chosen
            and (side := edge_of(param, chosen[key])) is not None}
