"""How a searched key is shown wherever one appears (the tuning table, the report's chosen values, a trial's run
name): `stages.<i>.<key>` as its stage's name and the whole key within the stage (`stages.1.server.lr` ->
`personalize.server.lr`), never cut short, so that no two keys of a pipeline read the same."""

from __future__ import annotations

from collections.abc import Sequence


def key_label(key: str, stages: Sequence[str]) -> str:
    """`key` with its stage index replaced by the stage's name (from `stages`, the pipeline's stage names in order);
    a key outside the stages, or of an index `stages` does not name, as it is."""
    head, index, rest = (key.split(".", 2) + ["", ""])[:3]
    if head != "stages" or not index.isdigit() or not rest or int(index) >= len(stages):
        return key
    return f"{stages[int(index)]}.{rest}"


def key_labels(keys: Sequence[str], stages: Sequence[str]) -> dict[str, str]:
    """Each key's label (key_label); the whole key for any whose label another key's label or key also reads (a
    stage named like a dotted path: the labels stay unique)."""
    labels = {key: key_label(key, stages) for key in keys}
    taken = [*labels.values(), *(k for k in keys if labels[k] != k)]
    return {key: label if label == key or taken.count(label) == 1 else key for key, label in labels.items()}
