"""Every loss family and teacher source runs through the real loop on the embedded models."""

import json
import math

import pytest
import torch

from opdkit.config import Config, replace
from opdkit.loss_table import LOSS_NAMES
from opdkit.persist.checkpoints import validate_checkpoint
from opdkit.train import train

TINY = ("rollout.prompts_per_step=4", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=40",
        "budget.max_steps=3", "budget.max_wall_time_s=0", "optim.schedule=cosine", "publish.every_steps=0",
        "optim.warmup_steps=1", "runtime.threads=1")


def _run(tmp_path, *overrides):
    cfg = replace(Config(), *TINY, *overrides)
    res = train(cfg, tmp_path, log=lambda *a: None, progress=False)
    rows = [json.loads(line) for line in (tmp_path / "metrics" / "train.jsonl").read_text().splitlines()]
    return res, rows


@pytest.mark.parametrize("loss", LOSS_NAMES)
def test_each_loss_runs_with_finite_metrics(tmp_path, loss):
    res, rows = _run(tmp_path, f"loss.name={loss}")
    assert res.step == 3 and res.reason == "step_horizon" and [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        for key in ("loss", "kl", "grad_norm", "lr", "response_len", "truncated_frac", "tokens", "tokens_per_s"):
            assert r[key] is not None and math.isfinite(r[key]), (key, r)
    if loss != "sft":
        assert rows[0]["alignment"]["recompute_max_abs_dlogp"] < 1e-4
        assert rows[0]["kl"] > 0  # the student really differs from the teacher
    validate_checkpoint(tmp_path / "checkpoints" / "checkpoint-3")


def test_entry_clip_reports_clipped_mass(tmp_path):
    _, rows = _run(tmp_path, "loss.name=fkl", "loss.clip=entry", "loss.clip_tau=0.01")
    assert all(0 < r["clipped_mass"] <= 1 for r in rows)


@pytest.mark.parametrize("source", ["privileged_fixed", "privileged_ema", "privileged_live"])
def test_privileged_teachers(tmp_path, source):
    res, rows = _run(tmp_path, "loss.name=jsd", f"teacher.source={source}")
    assert res.step == 3 and all(math.isfinite(r["loss"]) for r in rows)


def test_lora_exports_a_merged_plain_model(tmp_path):
    res, rows = _run(tmp_path, "loss.name=rkl", "lora.enabled=true", "lora.r=4", "lora.alpha=8", "optim.lr=1e-2")
    ckpt = tmp_path / "checkpoints" / "checkpoint-3"
    validate_checkpoint(ckpt)
    from safetensors.torch import load_file

    names = load_file(ckpt / "model.safetensors").keys()
    assert not any("lora" in n or "base_layer" in n for n in names)


def test_zero_lr_leaves_the_student_unchanged(tmp_path):
    from safetensors.torch import load_file

    from opdkit import paths

    _run(tmp_path, "loss.name=k1", "optim.lr=0", "optim.schedule=constant")
    before = load_file(paths.student_path(Config()) / "model.safetensors")
    after = load_file(tmp_path / "checkpoints" / "checkpoint-3" / "model.safetensors")
    for k, v in after.items():
        assert torch.equal(v, before[k]), k
