"""The reference recipes (params overlays under recipes/) and the overlay loader."""

import re
from pathlib import Path

import pytest

from opdkit.config import ConfigError
from opdkit.recipes import load_config, overlay

ROOT = Path(__file__).resolve().parents[1]


def _load(name, *overrides):
    return load_config(ROOT / "params.yaml", ROOT / "recipes" / f"{name}.yaml", list(overrides))


# --- the seeded runs' settings, written from the seed documents (docs/replays.md), not from the recipes ----------

# seed 000, "How the baseline works": k1 OPD of all student weights with a frozen teacher, 4 samples of each of
# 2 prompts at temperature 1.0 up to 7,168 tokens, AdamW at a constant 1e-6 with no warmup (Probe C's "ten-step
# warmup" was a change), rows in stored order (shuffle=False), saves every 20 steps keeping 3, a 2,200-step ceiling
S1_BASELINE = {
    "loss.name": "k1", "teacher.source": "model", "lora.enabled": False,
    "rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 4, "rollout.temperature": 1.0,
    "rollout.max_new_tokens": 7168, "optim.lr": 1e-6, "optim.schedule": "constant", "optim.warmup_steps": 0,
    "data.order": "stored", "publish.every_steps": 20, "publish.keep": 3, "budget.max_steps": 2200,
    "publish.state_every_steps": 20, "publish.keep_states": 3,  # verl saved everything every 20 steps, kept 3
    "eval.protocol": "aime_final", "eval.n_samples": 32, "eval.max_new_tokens": 31744,
}
# seed 000, "How the submitted method works" (what its formal replay ran): the same data, sampling, signal and
# update, with an elapsed-time cosine from 1e-6 toward 1e-7, a nonbinding 4,000-step cap, HF saves every 100
# steps with retention three
S1_FORMAL = {**S1_BASELINE, "optim.schedule": "wallclock_cosine", "optim.lr": 1e-6, "optim.min_lr": 1e-7,
             "budget.max_steps": 4000, "publish.every_steps": 100, "publish.keep": 3,
             "publish.state_every_steps": 100, "publish.keep_states": 1}
S1_SECONDS_PER_STEP, S1_WALL_S = 20.14, 12 * 3600  # seed 002's shipped-solution throughput; the 12-hour retrain

# seed 004, recipe.env and "Code switches": learning_rate=5e-6 (constant), lora_r=64, lora_alpha=128, beta=0,
# jsd_token_clip=0.05 (per vocabulary entry: OPSD_CLIP_MODE=entry), temperature=1.1 (TRL's GKD samples and
# scores at it), lmbda=1, max_completion_length=1024, fixed_teacher=true, use_ema_teacher=false; 100 optimizer
# steps at global batch 32, training seed 42; OPSD_PAD_SIDE=right, OPSD_STUDENT_PROMPT=paper,
# OPSD_TEACHER_CONTEXT=solution, OPSD_DATA_SELECT=none; scored by AIME24 avg@12, sampling seed 20260610
OPSD_RELEASED = {
    "seed": 42, "teacher.source": "privileged_fixed", "lora.enabled": True, "lora.r": 64, "lora.alpha": 128,
    "loss.name": "jsd", "loss.jsd_beta": 0.0, "loss.clip": "entry", "loss.clip_tau": 0.05,
    "rollout.temperature": 1.1, "loss.teacher_temperature": 1.1, "rollout.max_new_tokens": 1024,
    "rollout.prompts_per_step": 32, "rollout.samples_per_prompt": 1, "optim.lr": 5e-6, "optim.schedule": "constant",
    "optim.warmup_steps": 0, "budget.max_steps": 100, "data.pad_side": "right", "data.prompt_format": "opsd_student",
    "data.teacher_context": "solution", "data.filters.answer_regex": "", "data.filters.min_reference_tokens": 0,
    "data.filters.exclude_sources": (), "data.filters.top_reference_fraction": 1.0,
    "eval.protocol": "aime24_avg12", "eval.n_samples": 12, "eval.seed": 20260610,
    # recipe.env's teacher_thinking=false, and seed 003's "thinking-mode student rollouts -8.4" (an ablation of
    # the released non-thinking student)
    "data.enable_thinking": False, "data.teacher_enable_thinking": False,
}
# seed 004's shipped change: lr_scheduler_type=cosine (HF: from the lr at step 0 to 0 at the last step), nothing else
OPSD_COSINE = {**OPSD_RELEASED, "optim.schedule": "cosine", "optim.lr": 5e-6, "optim.min_lr": 0.0}
# seed 003: answers matching -?\d{1,6} with a reference trace of >= 2,000 tokens; learning_rate=1e-5,
# lr_scheduler_type=linear (to 0 over the 100 steps)
OPSD_SELECT_LINEAR = {**OPSD_RELEASED, "data.filters.answer_regex": r"-?\d{1,6}",
                      "data.filters.min_reference_tokens": 2000, "optim.schedule": "linear", "optim.lr": 1e-5,
                      "optim.min_lr": 0.0}

SEEDED = {"s1": S1_BASELINE, "s1_cosine": S1_FORMAL, "opsd_released": OPSD_RELEASED, "opsd_cosine": OPSD_COSINE,
          "opsd_select_linear": OPSD_SELECT_LINEAR}


def resolved(cfg, key):
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value


def mismatches(cfg, table: dict) -> dict:
    return {k: (resolved(cfg, k), v) for k, v in table.items() if resolved(cfg, k) != v}


@pytest.mark.parametrize("params", [None, ROOT / "params.yaml"], ids=["built-in defaults", "params.yaml"])
@pytest.mark.parametrize("name", list(SEEDED))
def test_each_recipe_resolves_to_its_seeded_run(name, params):
    """Under the built-in defaults (run.sh) or the pipeline's params.yaml alike: params.yaml's 120-step horizon
    and its checkpoints every 40 steps do not leak into a seeded run."""
    cfg = load_config(params, ROOT / "recipes" / f"{name}.yaml")
    assert mismatches(cfg, SEEDED[name]) == {}


def test_the_s1_step_caps_do_not_bind_before_the_wall_budget():
    for name in ("s1", "s1_cosine"):
        cfg = load_config(None, ROOT / "recipes" / f"{name}.yaml")
        assert cfg.budget.max_steps * S1_SECONDS_PER_STEP > S1_WALL_S  # the wall clock ends the run
        # a 12-hour budget of its own (MAX_WALL_TIME_SECONDS replaces it)
        assert cfg.budget.max_wall_time_s == S1_WALL_S
    # the wall-clock cosine runs down over the wall budget: from 1e-6 to 1e-7 when the loop stops
    from opdkit.schedules import lr_at

    cfg = load_config(None, ROOT / "recipes" / "s1_cosine.yaml")
    kw = dict(step=0, total_steps=cfg.budget.max_steps, budget_s=S1_WALL_S, lr=cfg.optim.lr, min_lr=cfg.optim.min_lr,
              warmup_steps=cfg.optim.warmup_steps)
    assert lr_at(cfg.optim.schedule, elapsed_s=0.0, **kw) == pytest.approx(1e-6)
    assert lr_at(cfg.optim.schedule, elapsed_s=S1_WALL_S, **kw) == pytest.approx(1e-7)


def test_the_annealed_opsd_schedules_keep_the_seeds_average():
    """Seed 003: linear 1e-5 -> 0 has the released constant 5e-6 as its average; seed 004: cosine over 100 steps
    has about half the constant schedule's cumulative lr."""
    from opdkit.schedules import lr_at

    def mean_lr(name):
        cfg = load_config(None, ROOT / "recipes" / f"{name}.yaml")
        return sum(lr_at(cfg.optim.schedule, step=s, total_steps=cfg.budget.max_steps, elapsed_s=0.0, budget_s=0.0,
                         lr=cfg.optim.lr, min_lr=cfg.optim.min_lr, warmup_steps=cfg.optim.warmup_steps)
                   for s in range(100)) / 100

    assert mean_lr("opsd_select_linear") == pytest.approx(5e-6, rel=0.02)
    assert mean_lr("opsd_cosine") == pytest.approx(0.5 * mean_lr("opsd_released"), rel=0.02)


def test_the_released_objective_is_the_per_entry_clipped_forward_kl():
    """The recipe's loss (the kit's jsd at beta 0, clip=entry, temperature 1.1) against the released summands
    sum_v min(p_T(v) log(p_T(v)/p_S(v)), tau) of softmax(logits / 1.1) (scipy's rel_entr), token-averaged;
    its gradient in the student's logits is the seed's (-p_T * unclipped + M p_S) / T, M = unclipped teacher mass;
    and the loss can go negative (the seed's ~ -0.008)."""
    import numpy as np
    import torch
    from scipy.special import rel_entr, softmax

    from opdkit import loss_table
    from opdkit.engines.sampling import policy_logits

    cfg = load_config(None, ROOT / "recipes" / "opsd_released.yaml")
    spec = loss_table.spec(cfg.loss.name)
    T, tau = cfg.loss.teacher_temperature, cfg.loss.clip_tau
    # the student side: the sampled policy, untruncated
    assert cfg.rollout.temperature == T and cfg.rollout.top_p == 1.0
    g = torch.Generator().manual_seed(0)
    s_logits = (3 * torch.randn(2, 5, 40, generator=g, dtype=torch.float64)).requires_grad_(True)
    t_logits = s_logits.detach() + 2.5 * torch.randn(2, 5, 40, generator=g, dtype=torch.float64)
    mask = torch.ones(2, 5, dtype=torch.float64)
    mask[1, 3:] = 0
    t_logp = torch.log_softmax(t_logits, -1)  # the teacher's log-probs at temperature 1, as the kit scores them
    policy = loss_table.update_policy(cfg.loss, cfg.rollout)  # what step.chunk_loss hands the loss
    loss, _ = spec.function(policy_logits(s_logits, *policy), t_logp, mask, float(mask.sum()),
                                       **spec.params(cfg.loss))

    p_S, p_T = softmax(s_logits.detach().numpy() / T, -1), softmax(t_logits.numpy() / T, -1)
    terms = rel_entr(p_T, p_S)
    want = (np.minimum(terms, tau).sum(-1) * mask.numpy()).sum() / mask.numpy().sum()
    assert float(loss.detach()) == pytest.approx(want, rel=1e-6)  # the kit computes in fp32

    (grad,) = torch.autograd.grad(loss, s_logits)
    unclipped = terms <= tau
    M = (p_T * unclipped).sum(-1, keepdims=True)
    want_grad = (-p_T * unclipped + M * p_S) / T * mask.numpy()[..., None] / mask.numpy().sum()
    np.testing.assert_allclose(grad.numpy(), want_grad, atol=1e-8)
    assert np.abs(want_grad).max() > 1e-3

    # the negative loss: the teacher far more certain than the student of one entry (its summand clipped at tau),
    # less certain elsewhere (negative summands survive)
    s2 = torch.tensor([[[2.0, 2.0, 2.0, 2.0]]], dtype=torch.float64) * T
    t2 = torch.log_softmax(torch.tensor([[[6.0, 1.0, 1.0, 1.0]]], dtype=torch.float64) * T, -1)
    neg, _ = spec.function(policy_logits(s2, *policy), t2, torch.ones(1, 1, dtype=torch.float64), 1.0,
                                      **spec.params(cfg.loss))
    p_S2, p_T2 = softmax([2.0, 2.0, 2.0, 2.0]), softmax([6.0, 1.0, 1.0, 1.0])
    assert float(neg) == pytest.approx(float(np.minimum(rel_entr(p_T2, p_S2), tau).sum()), rel=1e-6) and float(neg) < 0


def test_s2_is_the_benchmark_workload():
    c = _load("s2")
    assert (c.teacher.source, c.loss.name, c.loss.jsd_beta, c.loss.clip, c.loss.clip_tau) == (
        "privileged_fixed", "jsd", 0.5, "entry", 0.05)
    assert (c.lora.enabled, c.lora.r, c.lora.alpha) == (True, 64, 128)


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


def test_a_missing_extends_names_the_recipe_that_extends_it(tmp_path):
    """'extends' naming a file that is not there said only 'recipe .../gone.yaml does not exist': not which recipe
    named it (a chain may be several files long), nor that the path is relative to that recipe's folder."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "child.yaml").write_text("extends: gone.yaml\nloss:\n  name: k1\n")
    with pytest.raises(ConfigError, match=r"recipe .*sub/child\.yaml: 'extends: gone\.yaml' names .*sub/gone\.yaml, "
                                          r"which does not exist \(a path relative to the recipe's folder\)"):
        load_config(None, tmp_path / "sub" / "child.yaml")
    (tmp_path / "sub" / "list.yaml").write_text("extends: [a.yaml, b.yaml]\n")
    with pytest.raises(ConfigError, match=r"list\.yaml: 'extends' expected a recipe file .*got \['a\.yaml'"):
        load_config(None, tmp_path / "sub" / "list.yaml")


def _opdkit(argv: list[str], cwd: Path, capsys, monkeypatch) -> tuple[int, str]:
    """``opdkit ARGV`` run in ``cwd`` by the CLI's own entry point in this process (``python -m opdkit`` is
    ``raise SystemExit(main())``; a fresh interpreter would spend seconds importing torch): its exit status and
    stderr."""
    from opdkit.cli import main

    capsys.readouterr()
    with monkeypatch.context() as m:
        m.chdir(cwd)
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's usage errors
            code = e.code
    return code, capsys.readouterr().err


def test_cli_selects_a_recipe_with_one_option(tmp_path, capsys, monkeypatch):
    root = Path(__file__).resolve().parents[1]
    base = ["train", "--check", "--out", str(tmp_path / "o")]
    # S1 renders prompts with a chat template, which the embedded default's tokenizer lacks (--check says so)
    code, err = _opdkit(base + ["-r", str(root / "recipes" / "s1.yaml"), "-S", "data.chat_template=false"], tmp_path,
                        capsys, monkeypatch)
    assert code == 0, err
    code, err = _opdkit(base + ["-r", str(root / "recipes" / "nope.yaml")], tmp_path, capsys, monkeypatch)
    assert code == 2 and "nope.yaml does not exist" in err


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


def test_an_error_names_the_files_applied_and_only_those(tmp_path):
    """A bad value names the params file and recipe it was read with, and with neither says nothing of them
    (it said "(params None, recipe None)"); -r naming a directory says so (it said "does not exist")."""
    with pytest.raises(ConfigError) as e:
        load_config(None, "", ["optim.lr=abc"])
    assert str(e.value) == "params key 'optim.lr': expected float, got 'abc'"
    (tmp_path / "r.yaml").write_text("loss:\n  name: k1\n")
    with pytest.raises(ConfigError, match=rf"got 'abc' \(recipe {re.escape(str(tmp_path))}/r.yaml\)$"):
        load_config(None, tmp_path / "r.yaml", ["optim.lr=abc"])
    params = _params(tmp_path, "r.yaml")
    with pytest.raises(ConfigError, match=rf"got 'abc' \(params {re.escape(str(params))}, recipe .*r.yaml\)$"):
        load_config(params, None, ["optim.lr=abc"])
    with pytest.raises(ConfigError, match=r"recipe .* is a directory, not a YAML file \(-r/--recipe\)"):
        load_config(None, tmp_path)


def test_a_recipe_may_not_name_a_recipe_or_set_the_pipeline(tmp_path):
    (tmp_path / "a.yaml").write_text("recipe: b.yaml\n")
    with pytest.raises(ConfigError, match="a.yaml sets 'recipe'.*extends"):
        load_config(None, tmp_path / "a.yaml")
    (tmp_path / "b.yaml").write_text("pipeline:\n  seeds: [7]\n")
    (tmp_path / "c.yaml").write_text("extends: b.yaml\n")
    with pytest.raises(ConfigError, match="b.yaml sets 'pipeline'"):
        load_config(None, tmp_path / "c.yaml")


def test_the_cli_applies_the_params_recipe_and_r_wins(tmp_path, monkeypatch, capsys):
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
    code, err = _opdkit(["train", "--check", "--out", str(tmp_path / "o")], tmp_path, capsys, monkeypatch)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "params key 'recipe' in params.yaml names recipe recipes/nope.yaml, which does not exist" in lines[0]
