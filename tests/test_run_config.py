"""What a run publishes and resumes is the user's: the exported config.json keeps the source
student's settings whatever the runtime switched on (gradient checkpointing), and a step-based
learning-rate schedule keeps the horizon it started with when a resume changes budget.max_steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from opdkit import paths, schedules
from opdkit.config import load_config
from opdkit.setup import RunError
from opdkit.train import train

TINY = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=8", "runtime.threads=1",
        "budget.max_wall_time_s=0", "optim.warmup_steps=0", "optim.lr=1e-3"]


def _train(out: Path, *overrides: str):
    return train(load_config(None, [*TINY, *overrides]), out, log=lambda *_: None, progress=False)


def _rows(out: Path) -> list[dict]:
    return [json.loads(ln) for ln in (out / "metrics" / "train.jsonl").read_text().splitlines()]


def test_gradient_checkpointing_leaves_the_published_config_as_the_source_had_it(tmp_path):
    source = json.loads((paths.student_path(load_config(None)) / "config.json").read_text())
    assert source["use_cache"] is True
    _train(tmp_path / "out", "runtime.grad_checkpointing=true", "budget.max_steps=1", "optim.schedule=constant")
    published = json.loads((tmp_path / "out" / "checkpoints" / "checkpoint-1" / "config.json").read_text())
    assert published["use_cache"] is source["use_cache"]


def test_a_resume_that_would_reshape_the_cosine_is_refused_and_the_kept_horizon_is_followed(tmp_path):
    """max_steps 2 -> 4 under a step cosine: refused (nothing written); with
    budget.schedule_steps = the old horizon the resume runs and steps 3-4, past the horizon, run
    at optim.min_lr, the schedule's value, as the first start's learning rates promised."""
    out = tmp_path / "out"
    cosine = ("optim.schedule=cosine", "optim.min_lr=1e-5")
    _train(out, "budget.max_steps=2", *cosine, "publish.every_steps=2")
    before = sorted((p.relative_to(out), p.stat().st_mtime_ns) for p in out.rglob("*"))
    with pytest.raises(RunError, match=r"runs over 2 steps; these params would make it 4.*budget.schedule_steps=2"):
        _train(out, "budget.max_steps=4", *cosine)
    assert sorted((p.relative_to(out), p.stat().st_mtime_ns) for p in out.rglob("*")) == before
    res = _train(out, "budget.max_steps=4", "budget.schedule_steps=2", *cosine)
    assert res.step == 4
    lrs = [r["lr"] for r in _rows(out)]
    want = [schedules.lr_at("cosine", step=s, total_steps=2, elapsed_s=0, budget_s=0, lr=1e-3, min_lr=1e-5,
                            warmup_steps=0) for s in range(4)]
    assert lrs == pytest.approx(want) and lrs[1] > lrs[2] == lrs[3] == pytest.approx(1e-5)
