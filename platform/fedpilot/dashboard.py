"""What `fedpilot dashboard` serves: Optuna's dashboard on the platform database, its study list readable. A
comparison's study is named by its pipeline and a hash of what it searches (`digits-k2-fedalt.tune.2e01fb6b`), and
the dashboard lists a study by its name alone: here the list shows the comparison that last tuned it before that
name (`digits-k2-paper000: digits-k2-fedalt.tune.2e01fb6b`, from the study's user attribute `comparison`). The
studies keep their names: only the list's labels change."""

from __future__ import annotations

from typing import Any

from optuna.storages import RDBStorage
from optuna.study._frozen import FrozenStudy

from fedpilot.db import engine_options


def study_label(name: str, attrs: dict[str, Any]) -> str:
    """How the dashboard lists a study: `<comparison>: <name>` for a comparison's, else its name."""
    return f"{attrs['comparison']}: {name}" if attrs.get("comparison") else name


class LabelledStudies(RDBStorage):
    """The platform database's studies, listed by study_label."""

    def __init__(self, url: str):
        super().__init__(url, engine_kwargs=engine_options(url))

    def get_all_studies(self) -> list[FrozenStudy]:
        studies = super().get_all_studies()
        for study in studies:
            study.study_name = study_label(study.study_name, study.user_attrs)
        return studies
