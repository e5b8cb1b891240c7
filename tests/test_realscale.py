"""The real paths on the real-scale fixture (a qwen2 pair with Qwen2.5's 151,665-id tokenizer,
151,936 / 152,064 embedding rows, a chat template and generation configs that carry sampling
settings): run.sh and ``opdkit train`` for each loss family, the checkpoints they publish,
``opdkit eval`` on the MATH-500-shaped file, both studies, the alignment self-check, and scoring
over the shared vocabulary (issue 14, point 5) against a teacher with its padding rows removed."""

from __future__ import annotations

import contextlib
import json
import math
import subprocess
from pathlib import Path

import pytest
import torch

from opdkit.cli import main as opdkit_main
from opdkit.fixture import CHAT_TEMPLATE
from opdkit.persist.checkpoints import is_valid_checkpoint
from opdkit.persist.fsutil import list_checkpoints
from qwen2_fixture import fixture_dir

REPO = Path(__file__).resolve().parents[1]
N_IDS = 151665  # the tokenizer's ids (Qwen2.5: 151,643 ranks + 22 added tokens)
TINY = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=8", "runtime.threads=1",
        "optim.schedule=constant", "budget.max_wall_time_s=0", "runtime.logprob_chunk=8", "data.chat_template=true"]


@pytest.fixture(scope="module")
def fx(tmp_path_factory) -> Path:
    return fixture_dir(tmp_path_factory)


def _pair(fx: Path, student: Path | None = None) -> list[str]:
    return [f"student.path={student or fx / 'student'}", f"teacher.path={fx / 'teacher'}",
            f"data.train={fx / 'data' / 'train.parquet'}", f"data.eval={fx / 'data' / 'eval.parquet'}"]


def _cli(*args: str, overrides: list[str]) -> int:
    """``opdkit ARGS -p none -S ...`` in this process (the CLI's own entry point)."""
    return opdkit_main([*args, "-p", "none", "--quiet", *[x for kv in overrides for x in ("-S", kv)]])


def _metrics(out: Path) -> list[dict]:
    return [json.loads(ln) for ln in (out / "metrics" / "train.jsonl").read_text().splitlines()]


# --- run.sh, k1, and the checkpoint it publishes -------------------------------------------------


@pytest.fixture(scope="module")
def k1_run(fx, tmp_path_factory, runner):
    """run.sh's PYTHON: the warm runner's (conftest): its `python -m opdkit` commands (the trainer, the validation
    of its final checkpoint) run in children of the runner, spared a fresh interpreter's imports."""
    out = tmp_path_factory.mktemp("k1") / "out"
    proc = subprocess.run(["bash", str(REPO / "run.sh"), *TINY, "loss.name=k1", "budget.max_steps=2",
                           "publish.every_steps=2"], cwd=out.parent, text=True, capture_output=True, timeout=600,
                          env=runner.env(OUTPUT_DIR=str(out), STUDENT_MODEL=str(fx / "student"),
                                         TEACHER_MODEL=str(fx / "teacher"),
                                         TRAIN_DATA=str(fx / "data" / "train.parquet")))
    return proc, out


def test_run_sh_k1_on_the_fixture_publishes_a_checkpoint_plain_transformers_loads(k1_run, fx):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    proc, out = k1_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"shared vocabulary: scoring over the tokenizer's {N_IDS:,} ids; embedding rows student model 151,936, " \
           "teacher model 152,064" in proc.stdout
    assert "alignment check passed at step 1" in proc.stdout
    final = out / "checkpoints" / "checkpoint-2"
    assert list_checkpoints(out / "checkpoints") == [final] and is_valid_checkpoint(final) == (True, "ok")

    model = AutoModelForCausalLM.from_pretrained(str(final))
    start = AutoModelForCausalLM.from_pretrained(str(fx / "student"), dtype=torch.float32)
    assert model.config.model_type == "qwen2" and model.get_output_embeddings().weight.shape[0] == 151936
    assert all(torch.isfinite(p).all() for p in model.parameters())
    moved = model.model.layers[0].mlp.down_proj.weight - start.model.layers[0].mlp.down_proj.weight
    assert moved.abs().max() > 0  # it trained
    tok, ref = AutoTokenizer.from_pretrained(str(final)), AutoTokenizer.from_pretrained(str(fx / "student"))
    probe = r"Solve $\frac{x}{2} = 3$. 答案：6 🙂"
    assert len(tok) == N_IDS and tok(probe).input_ids == ref(probe).input_ids
    assert tok.chat_template == CHAT_TEMPLATE and (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    g, g0 = GenerationConfig.from_pretrained(str(final)), GenerationConfig.from_pretrained(str(fx / "student"))
    for key in ("do_sample", "temperature", "top_p", "repetition_penalty", "eos_token_id", "pad_token_id"):
        assert getattr(g, key) == getattr(g0, key), key


def test_recomputed_student_logprobs_match_the_sampling_time_ones_on_the_fixture(k1_run):
    """The student ships repetition_penalty 1.05 in its generation_config; the sampler must not
    inherit it (issue 14 point 3), so the first batch's recompute equals the sampling-time log-probs."""
    proc, out = k1_run
    first = _metrics(out)[0]
    assert first["alignment"]["recompute_max_abs_dlogp"] < 1e-4
    assert first["ratio_clipped_frac"] == 0.0  # step 1: the policy that sampled is the one scored


# --- each other loss family through `opdkit train` -------------------------------------------


@pytest.mark.parametrize("loss", ["rkl", "topk_fkl", "sft"])
def test_each_loss_family_trains_on_the_fixture(fx, tmp_path, loss, capsys):
    """One step of each other family (full-vocabulary, top-k, sft on teacher samples)."""
    out = tmp_path / "out"
    rc = _cli("train", "--out", str(out), overrides=[*_pair(fx), *TINY, f"loss.name={loss}", "budget.max_steps=1",
                                                     "publish.every_steps=1", "loss.topk=8"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err[-3000:]
    run = json.loads((out / "run.json").read_text())
    assert (run["status"], run["step"], run["checkpoints"]) == ("completed", 1, ["checkpoint-1"])
    assert is_valid_checkpoint(out / "checkpoints" / "checkpoint-1") == (True, "ok")
    row = _metrics(out)[0]
    assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]) and row["tokens"] > 0
    assert f"scoring over the tokenizer's {N_IDS:,} ids" in captured.out
    if loss != "sft":
        assert row["alignment"]["alignment_rows"] == 4
    if loss == "topk_fkl":
        assert row["alignment"]["recompute_max_abs_dlogp"] < 1e-4


# --- eval and the studies ----------------------------------------------------------------------


def test_eval_on_the_math500_shaped_file(fx, tmp_path):
    out = tmp_path / "eval.json"
    rc = _cli("eval", "--model", str(fx / "student"), "--data", str(fx / "data" / "eval.parquet"), "--out", str(out),
              overrides=["eval.n_samples=1", "eval.max_new_tokens=8", "eval.max_questions=4", "data.chat_template=true",
                         "runtime.threads=1"])
    assert rc == 0
    summary = json.loads(out.read_text())
    assert summary["n_questions"] == 4 and 0.0 <= summary["accuracy"] <= 1.0
    assert len(out.with_suffix(".jsonl").read_text().splitlines()) == 4  # one record per (question, sample)


STUDY = ["studies.n_prompts=2", "studies.samples_per_prompt=1", "rollout.max_new_tokens=8", "runtime.threads=1",
         "data.chat_template=true", "runtime.logprob_chunk=8"]


def test_padding_study_on_the_pair(fx, tmp_path):
    overrides = [*_pair(fx), *STUDY, "studies.padding_k=[0, 4]"]
    assert _cli("study", "padding", "--out", str(tmp_path), overrides=overrides) == 0
    res = json.loads((tmp_path / "padding.json").read_text())
    assert res["alignment"]["passed"] is True and res["k"] == [0, 4]
    assert all(abs(v) < 1e-4 for v in res["kl_left"])  # left padding leaves the scores alone, at V = 151,665 too
    assert res["kl_right"][1] > 1e-4 and math.isfinite(res["signal_kl"])


def test_clipped_mass_study_on_the_pair(fx, tmp_path):
    assert _cli("study", "clipped-mass", "--out", str(tmp_path),
                overrides=[*_pair(fx), *STUDY, "studies.clip_tau=[0, 0.05, inf]"]) == 0
    res = json.loads((tmp_path / "clipped_mass.json").read_text())
    mass = res["clipped_mass"]
    assert mass[0] > 0 and mass[-1] == 0.0 and all(a >= b for a, b in zip(mass, mass[1:]))
    assert res["grad_cosine"][-1] == pytest.approx(1.0, abs=1e-6)


# --- issue 14 point 5: scoring over the shared vocabulary -------------------------------------

LOSSES = ["k1", "k3", "fkl", "rkl", "jsd", "topk_fkl", "topk_rkl", "sft"]


def _without_padding_rows(model, n: int):
    """An independent copy of ``model`` whose embedding and head are its rows ``0..n-1`` only."""
    import copy

    from opdkit.scoring import restrict_vocab

    cut = copy.deepcopy(model)
    H = model.config.hidden_size
    cut.model.embed_tokens = torch.nn.Embedding(n, H, _weight=model.model.embed_tokens.weight[:n].detach().clone())
    cut.lm_head = torch.nn.Linear(H, n, bias=False, dtype=model.lm_head.weight.dtype)
    with torch.no_grad():
        cut.lm_head.weight.copy_(model.lm_head.weight[:n])
    cut.config.vocab_size = n
    restrict_vocab(cut, n)  # rows == n: drops the restriction the copy inherited
    return cut.requires_grad_(any(p.requires_grad for p in model.parameters()))


def test_every_loss_scores_over_the_shared_vocabulary_like_a_teacher_without_padding_rows(fx):
    from dataclasses import replace

    from opdkit import opd, step as opd_step
    from opdkit.config import load_config
    from opdkit.data import encode_prompt, load_examples
    from opdkit.models import load_model, load_tokenizer
    from opdkit.pairs import use_shared_vocab
    from opdkit.scoring import completion_hidden, token_logprobs, unwrap

    cpu = torch.device("cpu")
    tok = load_tokenizer(fx / "student")
    student = load_model(fx / "student", cpu, torch.float32, "student model", trainable=True)
    teacher = load_model(fx / "teacher", cpu, torch.float32, "teacher model")
    logged = []
    models = {"student model": (fx / "student", student), "teacher model": (fx / "teacher", teacher)}
    assert use_shared_vocab(tok, models, log=logged.append) == N_IDS and "padding rows" in logged[0]
    student_cut, teacher_cut = _without_padding_rows(student, N_IDS), _without_padding_rows(teacher, N_IDS)

    data = load_config(None, ["data.chat_template=true"]).data
    examples = load_examples(fx / "data" / "eval.parquet", data)[:3]
    prompts = [encode_prompt(ex, tok, data) for ex in examples]
    sols = [tok(ex.solution, add_special_tokens=False).input_ids[:10] for ex in examples]
    ro = opd.reference_rollout(prompts, sols, tok.pad_token_id, tok.eos_token_id, cpu)
    batch = opd.Batch(ro, ro.prompt_ids_B_Sp, ro.prompt_mask_B_Sp)
    with torch.no_grad():  # sampling-time log-probs, from the model without padding rows
        h_B_T_H = completion_hidden(student_cut, opd.student_geometry(batch))
        logp_B_T = token_logprobs(student_cut.lm_head, h_B_T_H, ro.completion_ids_B_T, 8) * ro.completion_mask_B_T
        batch = opd.Batch(replace(ro, sampling_logp_B_T=logp_B_T), ro.prompt_ids_B_Sp, ro.prompt_mask_B_Sp)
        # the teeth: the teacher's padding rows hold mass, so scoring over all 152,064 rows differs
        t_h = completion_hidden(teacher, opd.teacher_geometry(batch))
        all_rows = token_logprobs(teacher.lm_head, t_h, ro.completion_ids_B_T, 8)
        shared = token_logprobs(unwrap(teacher)[1], t_h, ro.completion_ids_B_T, 8)
        cut = token_logprobs(teacher_cut.lm_head, completion_hidden(teacher_cut, opd.teacher_geometry(batch)),
                             ro.completion_ids_B_T, 8)
    m_B_T = ro.completion_mask_B_T.bool()
    gain = (shared - all_rows)[m_B_T]  # renormalised over 151,665 ids: larger by the padding rows' mass
    assert gain.min() > 1e-6 and gain.max() > 1e-3
    torch.testing.assert_close(shared, cut, rtol=0, atol=2e-5)

    # The losses and gradients in float64. In float32 the two sides differ by rounding alone: the
    # restricted head slices the logits of the full head, so the backward's dL/dh sums over 152,064 head
    # rows (the padding rows' terms exactly 0) where the cut model's sums over 151,665, a GEMM of another
    # shape and summation order; with k3's gradients up to ~1e5 (exp of teacher-student log-ratios of
    # random models) that is ~1e-2 absolute, 5e-7 of the gradient's norm, the same relative size as
    # every other loss's. In float64 the two agree to the last bit here, so any leak of the padding rows
    # into a normaliser (a relative 1e-6..1e-3 change, as `gain` shows) is far outside the tolerance.
    for m in (student, teacher, student_cut, teacher_cut):
        m.double()
    probe = ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight")
    for name in LOSSES:
        cfg = load_config(None, [f"loss.name={name}", "runtime.logprob_chunk=16", "loss.topk=8"])
        results = []
        for s_model, t_model in ((student, teacher), (student_cut, teacher_cut)):
            s_model.zero_grad(set_to_none=True)
            kw = {"rollout": cfg.rollout, "runtime": cfg.runtime, "micro_batch": cfg.optim.micro_batch}
            contexts = opd_step.score_batch(cfg.loss, t_model, batch, contextlib.nullcontext, **kw)
            m = opd_step.micro_losses(cfg.loss, s_model, batch, contexts, contextlib.nullcontext, **kw)
            grads = dict(s_model.named_parameters())
            results.append((m, {k: grads[k].grad.clone() for k in probe}, grads["lm_head.weight"].grad.clone()))
        (m_a, g_a, head_a), (m_b, g_b, head_b) = results
        assert math.isfinite(m_a["loss"]), name
        assert m_a["loss"] == pytest.approx(m_b["loss"], rel=1e-5, abs=1e-6), name
        for key in ("kl",):
            if m_b.get(key) is not None:
                assert m_a[key] == pytest.approx(m_b[key], rel=1e-5, abs=1e-6), (name, key)
        for k in probe:
            torch.testing.assert_close(g_a[k], g_b[k], rtol=1e-9, atol=1e-12, msg=f"{name}: {k}")
        torch.testing.assert_close(head_a[:N_IDS], head_b, rtol=1e-9, atol=1e-12, msg=f"{name}: lm_head")
        assert not head_a[N_IDS:].any(), name  # padding rows take no part


def test_a_sampled_padding_id_fails_loudly_at_scoring():
    """An id past the tokenizer's (a padding row, which a sampler over all rows can emit) has no
    log-prob over the shared vocabulary: scoring says so instead of indexing past the logits."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from opdkit.scoring import restrict_vocab, token_logprobs, unwrap

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=48, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    restrict_vocab(model, 40)
    _, head = unwrap(model)
    h_B_T_H = torch.randn(1, 3, 16)
    logp_B_T = token_logprobs(head, h_B_T_H, torch.tensor([[1, 39, 7]]), chunk=2)
    ids_B_T_1 = torch.tensor([[[1], [39], [7]]])
    ref_B_T = (h_B_T_H @ model.lm_head.weight[:40].T).log_softmax(-1).gather(-1, ids_B_T_1)[..., 0]
    torch.testing.assert_close(logp_B_T, ref_B_T.detach())
    with pytest.raises(ValueError, match="token id 45 is outside the 40 ids scored"):
        token_logprobs(head, h_B_T_H, torch.tensor([[1, 45, 7]]), chunk=2)


def test_the_decode_loop_samples_what_generate_samples_on_the_real_vocabulary(fx):
    """The HF engine's decode loop against transformers' generate (tests/generate_reference.py) on the
    fixture's student: 151,936 rows over 151,665 ids, a generation_config with repetition_penalty 1.05
    that neither applies: the same tokens and log-probs, bit for bit, at the default and at 0.6 / 0.95."""
    from generate_reference import generate_reference
    from opdkit.engines.hf import HFEngine
    from opdkit.models import load_model, load_tokenizer

    model, tok = load_model(fx / "student", torch.device("cpu")), load_tokenizer(fx / "student")
    assert model.generation_config.repetition_penalty == 1.05
    rows = [tok("What is 12 + 30?").input_ids, tok("Solve for x: 2x = 8. Give x.").input_ids]
    eng = HFEngine(model, tok, static_cache=False)
    for temperature, top_p in ((1.0, 1.0), (0.6, 0.95)):
        ids, mask, ref_ids, ref_logp = generate_reference(model, tok, rows, [5, 6], temperature, top_p, 6)
        got_ids, got_logp = eng._hf_generate(ids, mask, [5, 6], temperature, top_p, 6)
        assert torch.equal(got_ids, ref_ids) and torch.equal(got_logp, ref_logp) and int(ref_ids.max()) < N_IDS
