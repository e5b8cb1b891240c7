"""Mechanism studies on real student rollouts: padding offsets and clipped mass.

``padding_study(cfg, out)`` and ``clipped_mass_study(cfg, out)`` each write a JSON and PNG
figures into ``out`` and return the JSON's content (see their docstrings for the schema). The
pure pieces (layouts, KL between scorings, clip statistics) are importable on their own.
"""

from opdkit.studies.clipped_mass import clipped_mass_stats, clipped_mass_study, entry_clip_stats, fkl_grad, score_chunks
from opdkit.studies.common import StudySetup, jsonable, prepare
from opdkit.studies.padding import (
    ScoredGeometry,
    hidden_at,
    kl_between,
    left_pad_geometry,
    padding_offsets,
    padding_study,
    reference_geometry,
    right_pad_geometry,
    token_kl,
)

__all__ = [
    "ScoredGeometry", "StudySetup", "clipped_mass_stats", "clipped_mass_study", "entry_clip_stats", "fkl_grad",
    "hidden_at", "jsonable", "kl_between", "left_pad_geometry", "padding_offsets", "padding_study", "prepare",
    "reference_geometry", "right_pad_geometry", "score_chunks", "token_kl",
]
