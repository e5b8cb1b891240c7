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
    # S1 renders prompts with a chat template, which the embedded default's tokenizer lacks (--check says so)
    ok = subprocess.run(base + ["-r", str(root / "recipes" / "s1.yaml"), "-S", "data.chat_template=false"],
                        capture_output=True, text=True, cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run(base + ["-r", str(root / "recipes" / "nope.yaml")], capture_output=True, text=True, cwd=tmp_path)
    assert bad.returncode == 2 and "nope.yaml does not exist" in bad.stderr


# --- the recipe the params name (params key `recipe`) ----------------------------------------------


def _params(tmp_path, recipe_key, **recipes):
    """A params file naming ``recipe_key`` and recipe files beside it (name -> YAML text)."""
    for name, text in recipes.items():
        (tmp_path / name).write_text(text)
    p = tmp_path / "params.yaml"
    p.write_text(f"recipe: {recipe_key!r}\nloss:\n  name: rkl\noptim:\n  lr: 1.0e-4\n")
    return p


def test_the_embedded_recipe_changes_nothing():
    from opdkit.config import load_config as load_as_is, to_dict

    assert load_as_is(ROOT / "params.yaml").recipe == "recipes/embedded.yaml"  # what the pipeline pins
    with_recipe = load_config(ROOT / "params.yaml")  # params < recipes/embedded.yaml
    assert with_recipe == load_as_is(ROOT / "params.yaml") and with_recipe.recipe == "recipes/embedded.yaml"
    without = load_config(ROOT / "params.yaml", "")  # "" applies none
    assert to_dict(without) == {**to_dict(with_recipe), "recipe": ""}
    defaults = load_config(None, ROOT / "recipes" / "embedded.yaml")
    assert to_dict(defaults) == {**to_dict(load_as_is(None)), "recipe": str(ROOT / "recipes" / "embedded.yaml")}


def test_the_params_recipe_applies_relative_to_the_params_file(tmp_path, monkeypatch):
    params = _params(tmp_path, "r/k1.yaml")
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "k1.yaml").write_text("loss:\n  name: k1\noptim:\n  lr: 2.0e-6\n")
    monkeypatch.chdir(tmp_path.parent)  # not the params file's folder
    c = load_config(params)
    assert (c.loss.name, c.optim.lr, c.recipe) == ("k1", 2e-6, "r/k1.yaml")
    c = load_config(params, None, ["optim.lr=3e-6"])  # params < recipe < -S
    assert (c.loss.name, c.optim.lr) == ("k1", 3e-6)
    # -S recipe=... names another one (also beside the params file); -S recipe= none
    (tmp_path / "r" / "jsd.yaml").write_text("loss:\n  name: jsd\n")
    c = load_config(params, None, ["recipe=r/jsd.yaml"])
    assert (c.loss.name, c.optim.lr, c.recipe) == ("jsd", 1e-4, "r/jsd.yaml")
    c = load_config(params, None, ["recipe="])
    assert (c.loss.name, c.recipe) == ("rkl", "")


def test_an_explicit_recipe_wins_over_the_params_one(tmp_path):
    params = _params(tmp_path, "k1.yaml", **{"k1.yaml": "loss:\n  name: k1\n", "sft.yaml": "loss:\n  name: sft\n"})
    c = load_config(params, tmp_path / "sft.yaml", ["recipe=k1.yaml"])  # -r beats -S recipe= too
    assert (c.loss.name, c.recipe) == ("sft", str(tmp_path / "sft.yaml"))
    assert load_config(params, "").loss.name == "rkl"  # -r '': none


def test_a_missing_recipe_names_the_file_and_the_key(tmp_path):
    params = _params(tmp_path, "recipes/nope.yaml")
    with pytest.raises(ConfigError) as e:
        load_config(params)
    msg = str(e.value)
    assert f"params key 'recipe' in {params} names recipe recipes/nope.yaml, which does not exist" in msg
    assert "\n" not in msg
    with pytest.raises(ConfigError, match=r"params key 'recipe' \(-S recipe=other.yaml\) names recipe other.yaml"):
        load_config(params, None, ["recipe=other.yaml"])
    with pytest.raises(ConfigError, match=r"params key 'recipe'.*expected str"):
        load_config(params, None, ["recipe=[1, 2]"])


def test_a_recipe_may_not_name_a_recipe_or_set_the_pipeline(tmp_path):
    (tmp_path / "a.yaml").write_text("recipe: b.yaml\n")
    with pytest.raises(ConfigError, match="a.yaml sets 'recipe'.*extends"):
        load_config(None, tmp_path / "a.yaml")
    (tmp_path / "b.yaml").write_text("pipeline:\n  seeds: [7]\n")
    (tmp_path / "c.yaml").write_text("extends: b.yaml\n")
    with pytest.raises(ConfigError, match="b.yaml sets 'pipeline'"):
        load_config(None, tmp_path / "c.yaml")


def test_the_cli_applies_the_params_recipe_and_r_wins(tmp_path, monkeypatch):
    import subprocess
    import sys

    from opdkit.cli import _config, build_parser

    params = _params(tmp_path, "k1.yaml", **{"k1.yaml": "loss:\n  name: k1\n", "sft.yaml": "loss:\n  name: sft\n"})
    monkeypatch.chdir(tmp_path)

    def cfg(*argv):
        return _config(build_parser().parse_args(["train", "--out", "o", *argv]))

    assert (cfg().loss.name, cfg().recipe) == ("k1", "k1.yaml")  # ./params.yaml and the recipe it names
    assert cfg("-r", "sft.yaml").loss.name == "sft" and cfg("-r", "").loss.name == "rkl"
    assert cfg("-r", "sft.yaml", "-S", "loss.name=jsd").loss.name == "jsd"
    assert cfg("-p", "none").recipe == ""
    assert "'recipe' key is applied" in build_parser()._subparsers._group_actions[0].choices["train"].format_help()

    params.write_text("recipe: recipes/nope.yaml\n")
    bad = subprocess.run([sys.executable, "-m", "opdkit", "train", "--check", "--out", str(tmp_path / "o")],
                         capture_output=True, text=True, cwd=tmp_path)
    lines = bad.stderr.strip().splitlines()
    assert bad.returncode == 2 and len(lines) == 1, bad.stderr
    assert "params key 'recipe' in params.yaml names recipe recipes/nope.yaml, which does not exist" in lines[0]
