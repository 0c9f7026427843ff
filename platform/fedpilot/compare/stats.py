"""The comparison's statistics moved to `fedpilot.stats`, beneath compare/ and report/ alike. This module only keeps
compare.work's import of the study summary working until compare.work imports `fedpilot.stats.study` itself."""

from fedpilot.stats.study import StudySummary, study_summary

__all__ = ["StudySummary", "study_summary"]
