"""``teacher.source=privileged_live`` with LoRA is the current student, adapters on (issue 14,
point 4): after a few updates its scores equal the student's own log-probs on the privileged
input (computed here by a plain HF forward of each unpadded sequence), and differ from the
``privileged_fixed`` teacher's (the frozen base)."""

import pytest
import torch

from opdkit import opd, step as opd_step
from opdkit.config import Config, replace
from opdkit.engines.base import left_pad
from opdkit.engines.hf import HFEngine
from opdkit.persist import trainer_state
from opdkit.setup import build_run, prepare_inputs
from opdkit.train import train

LORA = ("lora.enabled=true", "lora.r=4", "lora.alpha=8", "optim.lr=1e-2", "loss.name=k1",
        "rollout.prompts_per_step=4", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=24",
        "budget.max_steps=3", "budget.max_wall_time_s=0", "optim.schedule=constant", "optim.warmup_steps=0",
        "publish.every_steps=0", "runtime.threads=1")


def _own_logp(model, prompt, completion):
    """log p of ``completion`` after ``prompt`` under ``model``'s plain forward (no pads)."""
    ids_1_S = torch.tensor([prompt + completion])
    with torch.no_grad():
        logp_S_V = model(input_ids=ids_1_S).logits[0].float().log_softmax(-1)
    cols = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(completion))
    return logp_S_V[cols, torch.tensor(completion)]


@pytest.fixture(scope="module")
def trained_state(tmp_path_factory):
    out = tmp_path_factory.mktemp("live")
    train(replace(Config(), *LORA, "teacher.source=privileged_live"), out, log=lambda *a: None, progress=False)
    return trainer_state.peek(out)


def _teacher_scores(source, state):
    cfg = replace(Config(), *LORA, f"teacher.source={source}")
    run = build_run(cfg, prepare_inputs(cfg), log=lambda *a: None)
    trainer_state.load_model(run, state)
    examples = run.inputs.examples[:3]
    ro = HFEngine(run.student, run.tokenizer).sample(run.prompts(examples), samples_per_prompt=1, seeds=[7, 8, 9],
                                                     temperature=1.0, top_p=1.0, max_new_tokens=16)
    priv = run.prompts(examples, privileged=True)
    t_ids, t_mask = left_pad(priv, run.tokenizer.pad_token_id)
    ctx = opd_step.teacher_context(cfg.loss, run.teacher, opd.Batch(ro, t_ids, t_mask), slice(None), run.teacher_ctx,
                                   rollout=cfg.rollout, runtime=cfg.runtime)
    rows = []
    for b, p in enumerate(priv):  # (teacher score, the student's own, the frozen base's) per token
        n = int(ro.completion_mask_B_T[b].sum())
        comp = ro.completion_ids_B_T[b, :n].tolist()
        with run.student.disable_adapter():
            base = _own_logp(run.student, p, comp)
        rows.append((ctx.logp_B_T[b, :n], _own_logp(run.student, p, comp), base))
    return run, rows


def test_live_teacher_is_the_current_student_with_adapters(trained_state):
    assert trained_state["step"] == 3
    live_run, live = _teacher_scores("privileged_live", trained_state)
    lora_B = [p for n, p in live_run.student.named_parameters() if "lora_B" in n]
    assert lora_B and max(float(p.detach().abs().max()) for p in lora_B) > 1e-3  # the updates moved the adapters
    for teacher_N, own_N, _ in live:
        assert torch.allclose(teacher_N, own_N, atol=1e-5), (teacher_N - own_N).abs().max()
    # the adapters change the scores: live != the frozen base
    assert max(float((own_N - base_N).abs().max()) for _, own_N, base_N in live) > 1e-2

    _, fixed = _teacher_scores("privileged_fixed", trained_state)
    for (_, _, _), (fixed_N, _, base_N) in zip(live, fixed):
        assert torch.allclose(fixed_N, base_N, atol=1e-5)  # fixed: the frozen base (the initial student)
    assert max(float((live_N - fixed_N).abs().max()) for (live_N, _, _), (fixed_N, _, _) in zip(live, fixed)) > 1e-2
