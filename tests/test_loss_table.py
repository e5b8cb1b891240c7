"""The loss table (opdkit.loss_table) is the one declaration of the losses: every entry's function
exists and returns exactly the declared metrics from the declared inputs, the step asks the
teacher for exactly what the entry says, and the config, CLI help and README list the same names."""

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from opdkit import loss_table, opd, step as opd_step
from opdkit.config import CHOICES, Config, replace
from opdkit.engines.hf import HFEngine

ROOT = Path(__file__).resolve().parents[1]
B, T, V, K = 2, 3, 11, 4


def _inputs():
    g = torch.Generator().manual_seed(0)
    logits_B_T_V = torch.randn(B, T, V, generator=g).requires_grad_(True)
    teacher_B_T_V = torch.log_softmax(torch.randn(B, T, V, generator=g), -1)
    ids_B_T = torch.randint(0, V, (B, T), generator=g)
    logp_B_T = torch.log_softmax(logits_B_T_V, -1).gather(-1, ids_B_T[..., None])[..., 0]
    topk_B_T_K = teacher_B_T_V.topk(K, -1)
    return {"logp_B_T": logp_B_T, "old_logp_B_T": logp_B_T.detach() + 0.01,
            "teacher_logp_B_T": teacher_B_T_V.gather(-1, ids_B_T[..., None])[..., 0],
            "logits_B_T_V": logits_B_T_V, "teacher_logp_B_T_V": teacher_B_T_V,
            "topk_ids_B_T_K": topk_B_T_K.indices, "topk_logp_B_T_K": topk_B_T_K.values,
            "mask_B_T": torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]), "n_tokens": 5.0}


@pytest.mark.parametrize("name", loss_table.LOSS_NAMES)
def test_each_entry_calls_its_function_and_declares_its_metrics(name):
    spec = loss_table.spec(name)
    ins = _inputs()
    assert set(spec.inputs) <= set(ins) and spec.teacher in loss_table.TEACHER_NEEDS
    loss, metrics = spec.function(*(ins[k] for k in spec.inputs), **spec.params(Config().loss))
    assert loss.dim() == 0 and torch.isfinite(loss) and loss.requires_grad
    assert set(metrics) == set(spec.metrics), name


@pytest.mark.parametrize("name", loss_table.LOSS_NAMES)
def test_the_step_scores_what_the_table_says(name, tiny_llama, tok):
    cfg = replace(Config(), f"loss.name={name}", "loss.topk=3")
    ids = [tok(p).input_ids for p in ["Compute 4+5.", "Compute 12-3."]]
    ro = HFEngine(tiny_llama, tok).sample(ids, samples_per_prompt=1, seeds=[1, 2], temperature=1.0, top_p=1.0,
                                          max_new_tokens=6)
    batch = opd.Batch(ro, ro.prompt_ids_B_Sp, ro.prompt_mask_B_Sp)
    ctx = opd_step.teacher_context(cfg.loss, tiny_llama, batch, slice(None), rollout=cfg.rollout, runtime=cfg.runtime)
    want = {"recorded": {"logp_B_T"}, "token": {"logp_B_T", "head"},
            "topk": {"logp_B_T", "head", "topk_ids_B_T_K", "topk_logp_B_T_K"},
            "full": {"logp_B_T", "head", "hidden_B_T_H"}}[loss_table.teacher_need(cfg.loss, cfg.rollout)]
    assert {f.name for f in dataclasses.fields(ctx) if getattr(ctx, f.name) is not None} == want
    if name == "sft":
        ref = replace(cfg, "loss.sft_source=reference")
        assert loss_table.teacher_need(ref.loss, ref.rollout) == "none"
        assert opd_step.teacher_context(ref.loss, tiny_llama, batch, slice(None), rollout=ref.rollout,
                                        runtime=ref.runtime) is None
        # teacher samples at temperature 1, top-p 1: the recorded log-probs, equal to a teacher pass over them
        # (here the sampler, tiny_llama, is the teacher; the pass runs when the rollout settings are others)
        assert loss_table.teacher_need(cfg.loss, cfg.rollout) == "recorded"
        tempered = replace(cfg, "rollout.temperature=0.6")
        assert loss_table.teacher_need(tempered.loss, tempered.rollout) == "token"
        scored = opd_step.teacher_context(tempered.loss, tiny_llama, batch, slice(None), rollout=tempered.rollout,
                                          runtime=tempered.runtime).logp_B_T
        m = ro.completion_mask_B_T.bool()
        assert torch.equal(ctx.logp_B_T, ro.sampling_logp_B_T)
        torch.testing.assert_close(ctx.logp_B_T[m], scored[m], atol=1e-5, rtol=0)
    if name == "topk_fkl":
        assert ctx.topk_ids_B_T_K.shape[-1] == 3


def test_config_cli_help_and_readme_list_the_table():
    assert CHOICES["loss.name"] == loss_table.LOSS_NAMES
    from opdkit.cli import build_parser

    train_help = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    readme = (ROOT / "README.md").read_text()
    params = (ROOT / "params.yaml").read_text()
    for name in loss_table.LOSS_NAMES:
        assert re.search(rf"^\s+{name}\s", train_help, re.M), name
        assert f"`{name}`" in readme, name
    assert " | ".join(loss_table.LOSS_NAMES) in params  # the comment on loss.name


def test_no_loss_name_is_compared_outside_the_table():
    pattern = re.compile(r"""(loss\.name|L\.name)\s*(==|!=|in\b)""")
    hits = [f"{p.name}:{i}" for p in (ROOT / "opdkit").rglob("*.py") if p.name != "loss_table.py"
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, hits
