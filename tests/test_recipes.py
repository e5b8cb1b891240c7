"""The reference recipes (params overlays under recipes/) and the overlay loader."""

from pathlib import Path

import pytest

from opdkit.config import ConfigError
from opdkit.recipes import load_config, overlay

ROOT = Path(__file__).resolve().parents[1]


def _load(name, *overrides):
    return load_config(ROOT / "params.yaml", ROOT / "recipes" / f"{name}.yaml", list(overrides))


def test_s1_k1_opd():
    c = _load("s1")
    assert (c.loss.name, c.teacher.source, c.lora.enabled) == ("k1", "model", False)
    assert (c.rollout.prompts_per_step, c.rollout.samples_per_prompt, c.rollout.temperature, c.rollout.max_new_tokens) == (2, 4, 1.0, 7168)
    assert (c.optim.lr, c.optim.schedule, c.optim.warmup_steps) == (1e-6, "constant", 0)
    cos = _load("s1_cosine")
    assert (cos.optim.schedule, cos.optim.lr, cos.optim.min_lr) == ("wallclock_cosine", 1e-6, 1e-7)
    assert cos.rollout == c.rollout and cos.loss == c.loss  # the variant changes the schedule only


def test_s2_opsd():
    c = _load("s2")
    assert (c.teacher.source, c.loss.name, c.loss.clip, c.loss.clip_tau) == ("privileged_fixed", "jsd", "entry", 0.05)
    assert (c.lora.enabled, c.lora.r, c.lora.alpha) == (True, 64, 128)
    assert (c.rollout.temperature, c.rollout.max_new_tokens, c.rollout.prompts_per_step) == (1.1, 1024, 32)
    assert (c.optim.lr, c.optim.schedule) == (5e-6, "constant")
    assert _load("s2_cosine").optim.schedule == "wallclock_cosine"


def test_overrides_win_over_the_recipe_and_params_fill_the_rest():
    c = _load("s1", "optim.lr=2e-6", "budget.max_steps=7")
    assert c.optim.lr == 2e-6 and c.budget.max_steps == 7 and c.rollout.max_new_tokens == 7168
    assert c.publish.keep == load_config(ROOT / "params.yaml").publish.keep


def test_overlay_merges_sections_and_replaces_values():
    assert overlay({"a": {"x": 1, "y": [1, 2]}, "b": 1}, {"a": {"y": [3]}}) == {"a": {"x": 1, "y": [3]}, "b": 1}


def test_a_typo_in_a_recipe_names_the_key(tmp_path):
    (tmp_path / "base.yaml").write_text("loss:\n  name: k1\n")
    (tmp_path / "bad.yaml").write_text("extends: base.yaml\noptim:\n  learning_rate: 1.0e-6\n")
    with pytest.raises(ConfigError, match="optim.learning_rate"):
        load_config(None, tmp_path / "bad.yaml")
    (tmp_path / "loop.yaml").write_text("extends: loop.yaml\n")
    with pytest.raises(ConfigError, match="loops"):
        load_config(None, tmp_path / "loop.yaml")


def test_cli_selects_a_recipe_with_one_option(tmp_path):
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    base = [sys.executable, "-m", "opdkit", "train", "--check", "--out", str(tmp_path / "o")]
    ok = subprocess.run(base + ["-r", str(root / "recipes" / "s1.yaml")], capture_output=True, text=True, cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run(base + ["-r", str(root / "recipes" / "nope.yaml")], capture_output=True, text=True, cwd=tmp_path)
    assert bad.returncode == 2 and "nope.yaml does not exist" in bad.stderr
