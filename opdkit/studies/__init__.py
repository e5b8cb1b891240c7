"""The study's analyses, apart from the training library: what the pipeline's drivers (``opdkit.stages``) and the
notebooks call after training.

- ``report``: repeat-run statistics over eval JSONs (``opdkit report``), the pipeline's arms and matrix, the
  training curves the notebooks plot;
- ``inspection``: per-token log-probs of the student and the teacher on the student's samples (the rollout
  inspection notebook);
- the mechanism studies on real student rollouts: ``padding_study(cfg, out)`` and ``clipped_mass_study(cfg,
  out)`` each write a JSON and PNG figures into ``out`` and return the JSON's content (see their docstrings
  for the schema); the pure pieces (layouts, KL between scorings, clip statistics) are importable on their own.

The names below are imported from their submodules on first use, so ``opdkit.studies.report`` (no torch) stays
light.
"""

import importlib

_WHERE = {
    "clipped_mass": ("clipped_mass_stats", "clipped_mass_study", "entry_clip_stats", "fkl_grad", "score_chunks"),
    "common": ("StudySetup", "jsonable", "prepare"),
    "padding": ("ScoredGeometry", "hidden_at", "kl_between", "left_pad_geometry", "padding_offsets", "padding_study",
                "reference_geometry", "right_pad_geometry", "token_kl"),
}
_MODULE_OF = {name: mod for mod, names in _WHERE.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'opdkit.studies' has no attribute {name!r}")
    return getattr(importlib.import_module(f"opdkit.studies.{_MODULE_OF[name]}"), name)
