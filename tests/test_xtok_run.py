"""Cross-tokenizer OPD through the real loop, the vLLM teacher and the doctor: the embedded
(character-level) student against a small teacher with a byte-level BPE of its own (random weights,
saved as an HF directory)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import re

import pytest
import torch

from fake_vllm_server import FakeVLLMServer
from opdkit import opd, step as opd_step, xtok
from opdkit.cli import main as opdkit_main
from opdkit.config import Config, replace
from opdkit.embedded import asset, task
from opdkit.embedded.bpe_teacher import build_bpe_tokenizer
from opdkit.embedded.build import save_model
from opdkit.engines import vllm_teacher as vt
from opdkit.models import load_model, load_tokenizer
from opdkit.pairs import use_shared_vocab
from test_xtok import tiny_llama

TINY = ["rollout.prompts_per_step=3", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=30",
        "budget.max_steps=2", "budget.max_wall_time_s=0", "optim.schedule=constant", "publish.every_steps=0",
        "runtime.threads=1", "tracking=none", "teacher.tokenizer=own"]


@pytest.fixture(scope="module")
def bpe_teacher(tmp_path_factory):
    rows = task.make_splits(0, 400, 8, 3, 3)[0]
    tok = build_bpe_tokenizer([r["prompt"] + r["solution"] for r in rows], 320)
    d = tmp_path_factory.mktemp("bpe") / "teacher"
    save_model(tiny_llama(tok, 3), tok, d)
    return d


def _cli(*args, overrides):
    return opdkit_main([*args, "-p", "none", "--quiet", *[x for kv in overrides for x in ("-S", kv)]])


@pytest.mark.parametrize("loss", ["k1", "rkl"])
def test_training_across_tokenizers_runs_and_logs_the_alignment(bpe_teacher, tmp_path, loss):
    over = [*TINY, f"loss.name={loss}", f"teacher.path={bpe_teacher}"]
    assert _cli("train", "--out", str(tmp_path), overrides=over) == 0
    rows = [json.loads(ln) for ln in (tmp_path / "metrics" / "train.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert all(math.isfinite(r[k]) for k in ("loss", "kl", "grad_norm", "xtok_one_to_one_frac"))
        assert 0 < r["xtok_one_to_one_frac"] < 1  # the BPE merges characters: some spans are one-to-one, not all
        if loss == "rkl":
            assert 0 <= r["xtok_teacher_tail_mass"] < 1 and r["xtok_student_tail_mass"] == 0.0
    a = rows[0]["alignment"]
    assert a["teacher_view_alignment_rows"] == 6 and a["xtok_student_per_span"] > 1 and a["xtok_respelled_frac"] == 0


def test_training_with_the_teachers_tokenizer_shared_is_refused_with_the_fix(bpe_teacher, tmp_path, capsys):
    rc = _cli("train", "--check", "--out", str(tmp_path / "x"),
              overrides=[*TINY[:-1], "loss.name=k1", f"teacher.path={bpe_teacher}"])
    err = capsys.readouterr().err
    assert rc == 2 and "tokenizers disagree" in err and "teacher.tokenizer=own" in err


def _batch(student_tok, teacher_tok, student):
    from opdkit.data import encode_prompt, load_examples
    from opdkit.engines.hf import HFEngine

    data = Config().data
    examples = load_examples(asset("train"), data)[:3]
    ro = HFEngine(student, student_tok).sample([encode_prompt(ex, student_tok, data) for ex in examples],
                                               samples_per_prompt=2, seeds=list(range(6)), temperature=1.0, top_p=1.0,
                                               max_new_tokens=20)
    batch = opd.Batch(ro, ro.prompt_ids_B_Sp, ro.prompt_mask_B_Sp)
    pair = xtok.make_pair(student_tok, teacher_tok, (2,), (2,), 2)
    batch.xtok = xtok.teacher_view(pair, ro.completion_ids_B_T, ro.completion_mask_B_T,
                                   [encode_prompt(ex, teacher_tok, data) for ex in examples for _ in range(2)])
    return batch


def _settings(cfg) -> dict:
    """What ``step.score_batch`` reads of ``cfg`` besides its loss."""
    return {"rollout": cfg.rollout, "runtime": cfg.runtime, "micro_batch": cfg.optim.micro_batch}


def test_the_vllm_teacher_scores_the_retokenized_ids_as_the_hf_teacher(bpe_teacher, tmp_path):
    """The server is sent the teacher's own tokens (its prompt, the completion re-tokenized, its EOS) and
    its answers, moved onto the student's tokens, equal the HF teacher's; a run with the server trains."""
    s_tok, t_tok = load_tokenizer(asset("student")), load_tokenizer(bpe_teacher)
    student = load_model(asset("student"), torch.device("cpu"), torch.float32, "student model", trainable=True)
    teacher = load_model(bpe_teacher, torch.device("cpu"), torch.float32, "teacher model")
    use_shared_vocab(t_tok, {"t": (bpe_teacher, teacher)}, log=lambda _: None)
    batch = _batch(s_tok, t_tok, student)
    cfg = replace(Config(), "loss.name=k1", "teacher.source=vllm", "teacher.tokenizer=own", "optim.micro_batch=4")
    with FakeVLLMServer(teacher, str(bpe_teacher)) as server:
        client = vt.ServerTeacher(server.url, bpe_teacher, len(t_tok), 30.0, log=lambda *a: None)
        got = opd_step.score_batch(cfg.loss, client, batch, contextlib.nullcontext, **_settings(cfg))
    view = batch.xtok.teacher
    sent = server.requests[0]["prompt"]
    for b, seq in enumerate(sent):
        n = int(view.completion_mask_B_T[b].sum())
        assert seq == [t for t, m in zip(view.prompt_ids_B_Sp[b].tolist(), view.prompt_mask_B_Sp[b].tolist()) if m] + \
            view.completion_ids_B_T[b, :n].tolist()
    want = opd_step.score_batch(cfg.loss, teacher, batch, contextlib.nullcontext, **_settings(cfg))
    m = batch.rollout.completion_mask_B_T.bool()
    for g, w, rows in zip(got, want, opd_step.micro_slices(batch, cfg.optim.micro_batch)):
        torch.testing.assert_close(g.logp_B_T[m[rows]], w.logp_B_T[m[rows]], rtol=0, atol=2e-5)
    with FakeVLLMServer(teacher, str(bpe_teacher)) as server:
        over = [*TINY, "loss.name=k1", f"teacher.path={bpe_teacher}", "teacher.source=vllm",
                f"teacher.url={server.url}"]
        assert _cli("train", "--out", str(tmp_path), overrides=over) == 0
    assert len(server.requests) == 2


LINE = re.compile(r"^(OK|WARN|FAIL|SKIP) +(\S.*?)  +(.*)$")


def _doctor(capsys, *sets):
    capsys.readouterr()
    rc = opdkit_main(["doctor", "--quiet", "-p", "none", *[x for s in sets for x in ("-S", s)]])
    out = capsys.readouterr().out
    rows, last = {}, None
    for line in out.splitlines()[:-1]:
        m = LINE.match(line)
        if m:
            last = m.group(2).strip()
            rows[last] = [m.group(1), m.group(3)]
        elif not line.lstrip().startswith("> fix: "):
            rows[last][1] += " " + line.strip()
    return rc, rows


def test_the_doctor_reports_a_cross_tokenizer_pair_with_its_one_to_one_share(bpe_teacher, capsys):
    rc, rows = _doctor(capsys, f"teacher.path={bpe_teacher}", "teacher.tokenizer=own", "loss.name=rkl")
    assert rc == 0, rows
    status, detail = rows["vocabulary"]
    assert status == "OK" and detail.startswith("cross-tokenizer pair (teacher.tokenizer=own): student 33 ids")
    share = float(re.search(r"([\d.]+)% of [\d,]+ spans align one-to-one", detail).group(1))
    assert 20 < share < 95 and "on 64 rows' reference solutions" in detail and "vocabulary map (prefix)" in detail
    assert rows["embedding rows (teacher)"][0] == "OK" and rows["teacher repeat"][0] == "OK"
    rc, rows = _doctor(capsys, f"teacher.path={bpe_teacher}")
    assert rc == 1 and rows["vocabulary"][0] == "FAIL"


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                    reason="needs vllm (the vllm CI lane, or pip install -e '.[vllm]' on a GPU machine)")
def test_the_colocated_vllm_teacher_scores_the_retokenized_ids(tmp_path):
    """The colocated vLLM engine as a cross-tokenizer teacher: a small random Qwen2 (head_dim 64, as
    vLLM's CPU attention needs) with a BPE of its own and exactly its tokenizer's rows, scoring the
    embedded student's samples re-tokenized; its span log-probs on the student's tokens agree with the
    HF teacher's within the bf16 alignment tolerance."""
    from transformers import Qwen2Config

    from opdkit.models import random_model

    rows = task.make_splits(0, 400, 8, 3, 3)[0]
    t_tok = build_bpe_tokenizer([r["prompt"] + r["solution"] for r in rows], 320)
    cfg_m = Qwen2Config(vocab_size=len(t_tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
                        tie_word_embeddings=False, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    model = random_model(cfg_m, seed=5)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5)
    model.save_pretrained(tmp_path / "teacher")
    t_tok.save_pretrained(tmp_path / "teacher")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    s_tok = load_tokenizer(asset("student"))
    student = load_model(asset("student"), torch.device("cpu"), torch.float32, "student model", trainable=True)
    teacher = load_model(tmp_path / "teacher", torch.device("cpu"), torch.float32, "teacher model")
    batch = _batch(s_tok, t_tok, student)
    cfg = replace(Config(), "loss.name=k1", "teacher.source=vllm", "teacher.tokenizer=own",
                  "rollout.max_prompt_tokens=64", "teacher.gpu_memory_utilization=0.2")
    engine = vt.EngineTeacher(cfg, tmp_path / "teacher", len(t_tok), device)
    got = torch.cat([c.logp_B_T.cpu() for c in opd_step.score_batch(cfg.loss, engine, batch, contextlib.nullcontext,
                                                                      **_settings(cfg))])
    want = torch.cat([c.logp_B_T for c in opd_step.score_batch(cfg.loss, teacher, batch, contextlib.nullcontext,
                                                                  **_settings(cfg))])
    m = batch.rollout.completion_mask_B_T.bool()
    d = (got - want)[m].abs()
    tol_max, tol_mean = cfg.runtime.alignment_tol_bf16
    print(f"|vLLM - HF| span log-prob per student token: max {float(d.max()):.3g}, mean {float(d.mean()):.3g}")
    # the BPE is coarser than the student's characters: each span holds one teacher token, one bf16 rounding
    for t_span_U in batch.xtok.t_span_B_U:
        real_U = t_span_U[t_span_U >= 0]
        assert torch.unique(real_U).numel() == real_U.numel()
    assert float(d.max()) <= tol_max and float(d.mean()) <= tol_mean


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["k1", "rkl"])
def test_two_processes_across_tokenizers_match_one(bpe_teacher, tmp_path, loss, runner):
    """torchrun, 2 gloo ranks (FSDP2): each rank re-tokenizes and aligns its own rows and runs the head's
    no-grad pre-pass of merged spans on its own (the root is gathered then: no collective), one position
    per chunk; the steps equal one process's up to the order of float sums."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    sets = [*TINY, f"loss.name={loss}", f"teacher.path={bpe_teacher}", "runtime.logprob_chunk=1",
            "rollout.prompts_per_step=4", "rollout.max_new_tokens=48"]
    # (--no-python: each rank is `RUNNER_PYTHON -m opdkit train ...`, its command in a child of the warm runner,
    # conftest, with the rank's environment: spared a fresh interpreter's imports per rank)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "--no-python",
           str(runner.python), "-m", "opdkit", "train", "--out", str(tmp_path / "two"), "-p", "none", "--quiet",
           *[x for kv in sets for x in ("-S", kv)]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)}
    r = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=300)  # a hang fails here
    assert r.returncode == 0, r.stderr[-3000:]
    assert _cli("train", "--out", str(tmp_path / "one"), overrides=sets) == 0
    one, two = ([json.loads(ln) for ln in (tmp_path / k / "metrics" / "train.jsonl").read_text().splitlines()]
                for k in ("one", "two"))
    for a, b in zip(one, two):
        assert a["tokens"] == b["tokens"] and a["xtok_one_to_one_frac"] == b["xtok_one_to_one_frac"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["kl"] == pytest.approx(b["kl"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
