"""Resolve the params' paths: an empty path means the shipped embedded default."""

from __future__ import annotations

from pathlib import Path

from opdkit.config import Config


def student_path(cfg: Config) -> Path:
    from opdkit.embedded import asset

    return Path(cfg.student.path) if cfg.student.path else asset("student")


def teacher_path(cfg: Config) -> Path:
    from opdkit.embedded import asset

    return Path(cfg.teacher.path) if cfg.teacher.path else asset("teacher")


def train_data_path(cfg: Config) -> Path:
    from opdkit.embedded import asset

    return Path(cfg.data.train) if cfg.data.train else asset("train")


def eval_data_path(cfg: Config) -> Path:
    from opdkit.embedded import asset

    return Path(cfg.data.eval) if cfg.data.eval else asset("eval")


def project_root(start: str | Path | None = None) -> Path:
    """The nearest folder at or above ``start`` (default: the current directory) that holds
    ``dvc.yaml``: where the pipeline's relative paths (``params.yaml``, ``runs/...``) start, so a
    notebook opened from ``notebooks/`` finds them. ``start`` itself when no folder above has one."""
    here = Path(start if start is not None else Path.cwd()).resolve()
    return next((d for d in (here, *here.parents) if (d / "dvc.yaml").is_file()), here)
