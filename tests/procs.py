"""Helpers shared by the tests that run opdkit in real subprocesses."""

from __future__ import annotations

import os

RUN_ENV_KEYS = ("STUDENT_MODEL", "TEACHER_MODEL", "TRAIN_DATA", "PARAMS", "MAX_WALL_TIME_SECONDS",
                "DEADLINE_RESERVE_SECONDS", "OUTPUT_DIR", "NPROC", "EXPERIMENT_NAME", "PYTHON", "CKPT_DIR", "RECIPE",
                "OPDKIT_GPU_LOCK", "OPDKIT_LAUNCHED_AT", "OPDKIT_CONTRACT_OUT")


def env(**extra) -> dict:
    """The environment for a child opdkit process: no run.sh variables (nor OPSD_* switches) leaking in, one thread."""
    e = {k: v for k, v in os.environ.items() if k not in RUN_ENV_KEYS and not k.startswith("OPSD_")}
    e.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    e.update(extra)
    return e
