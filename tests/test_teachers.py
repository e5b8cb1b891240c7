"""Several teachers (params key ``teachers``, ``data.teacher_column``) on the real-scale fixture, and
the teacher on a device of its own (``teacher.device``): rows go to the teacher they name (each
teacher scored alone is the reference), the per-teacher metrics, the refusals, and the copy of the
head a teacher elsewhere uses for the full-vocabulary losses."""

from __future__ import annotations

import contextlib
import json
from dataclasses import replace as dc_replace
from pathlib import Path

import pytest
import torch

from opdkit import opd, step as opd_step, teachers
from opdkit.cli import main as opdkit_main
from opdkit.config import Config, load_config, replace
from opdkit.data import encode_prompt, load_examples, read_table
from opdkit.models import load_model, load_tokenizer
from opdkit.pairs import use_shared_vocab
from opdkit.scoring import completion_hidden, token_logprobs, unwrap
from qwen2_fixture import fixture_dir, teacher_of_seed, teacher_with_another_vocabulary

CPU = torch.device("cpu")
TINY = ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=8", "runtime.threads=1",
        "optim.schedule=constant", "budget.max_wall_time_s=0", "runtime.logprob_chunk=8", "data.chat_template=true",
        "publish.every_steps=0"]


@pytest.fixture(scope="module")
def fx(tmp_path_factory) -> Path:
    return fixture_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def teacher2(fx, tmp_path_factory) -> Path:
    """The fixture's teacher as the build with another seed writes it: other weights, the same tokenizer."""
    return teacher_of_seed(tmp_path_factory, fx, seed=1)


def _teachers(fx, teacher2) -> list[str]:
    return [f"teachers=[{{name: a, path: {fx / 'teacher'}}}, {{name: b, path: {teacher2}}}]",
            "data.teacher_column=teacher"]


def _routed_data(fx, dst: Path, names=("a", "b")) -> Path:
    """The fixture's DAPO-shaped rows with a 'teacher' column cycling through ``names``."""
    rows = read_table(fx / "data" / "train.parquet")
    dst.write_text("".join(json.dumps(r | {"teacher": names[i % len(names)]}) + "\n" for i, r in enumerate(rows)))
    return dst


@pytest.fixture(scope="module")
def models(fx, teacher2):
    tok = load_tokenizer(fx / "student")
    student = load_model(fx / "student", CPU, torch.float32, "student model", trainable=True)
    a = load_model(fx / "teacher", CPU, torch.float32, "teacher a model")
    b = load_model(teacher2, CPU, torch.float32, "teacher b model")
    use_shared_vocab(tok, {"s": (fx / "student", student), "a": (fx / "teacher", a), "b": (teacher2, b)},
                     log=lambda _: None)
    return tok, student, a, b


def _batch(fx, tok, student):
    """4 rows of the student's own continuations of MATH-500-shaped prompts, sampled at 0.6 / 0.95 (as
    the recipes do) with sampling-time log-probs; rows 0 and 3 name teacher a, rows 1 and 2 teacher b."""
    from opdkit.engines.hf import HFEngine

    data = load_config(None, ["data.chat_template=true"]).data
    examples = load_examples(fx / "data" / "eval.parquet", data)[:2]
    ro = HFEngine(student, tok).sample([encode_prompt(ex, tok, data) for ex in examples], samples_per_prompt=2,
                                       seeds=[1, 2, 3, 4], temperature=0.6, top_p=0.95, max_new_tokens=6)
    return opd.Batch(ro, ro.prompt_ids_B_Sp, ro.prompt_mask_B_Sp, teacher_B=torch.tensor([0, 1, 1, 0]))


def _rows(batch: opd.Batch, idx: list[int]) -> opd.Batch:
    """The batch of rows ``idx`` alone (one teacher)."""
    ro, i = batch.rollout, torch.tensor(idx)
    sub = dc_replace(ro, prompt_ids_B_Sp=ro.prompt_ids_B_Sp[i], prompt_mask_B_Sp=ro.prompt_mask_B_Sp[i],
                     completion_ids_B_T=ro.completion_ids_B_T[i], completion_mask_B_T=ro.completion_mask_B_T[i],
                     sampling_logp_B_T=ro.sampling_logp_B_T[i], truncated_B=ro.truncated_B[i],
                     prompt_index_B=ro.prompt_index_B[i])
    return opd.Batch(sub, batch.teacher_prompt_ids_B_Sp[i], batch.teacher_prompt_mask_B_Sp[i])


def _settings(cfg) -> dict:
    """What ``step.score_batch`` / ``step.micro_losses`` read of ``cfg`` besides its loss."""
    return {"rollout": cfg.rollout, "runtime": cfg.runtime, "micro_batch": cfg.optim.micro_batch}


def _grads(student) -> dict[str, torch.Tensor]:
    out = {k: p.grad.clone() for k, p in student.named_parameters() if p.grad is not None}
    student.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("loss", ["k1", "topk_fkl", "rkl"])
def test_rows_are_scored_by_the_teacher_they_name(fx, teacher2, models, loss):
    """Each row's teacher scores are those of its teacher scored alone; the step's gradient is the sum of
    each teacher's rows' gradients (the step's token mean); the per-teacher loss and KL are each teacher's
    own. Micro-batches of 3 rows cross the teachers' rows (0, 3: a; 1, 2: b)."""
    tok, student, a, b = models
    batch = _batch(fx, tok, student)
    common = [f"loss.name={loss}", "loss.topk=8", "runtime.logprob_chunk=4", "rollout.temperature=0.6",
              "rollout.top_p=0.95"]
    cfg = load_config(None, [*common, *_teachers(fx, teacher2), "optim.micro_batch=3"])
    one = load_config(None, common)
    nc = contextlib.nullcontext
    kw, kw_one = _settings(cfg), _settings(one)
    routed = opd_step.score_batch(cfg.loss, teachers.TeacherSet(("a", "b"), [a, b]), batch, nc, **kw)
    # every row, one call
    alone = {name: opd_step.score_batch(one.loss, t, batch, nc, **kw_one)[0] for name, t in (("a", a), ("b", b))}
    got = torch.cat([c.logp_B_T for c in routed])
    for name, rows in (("a", [0, 3]), ("b", [1, 2])):
        torch.testing.assert_close(got[rows], alone[name].logp_B_T[rows], rtol=0, atol=1e-5)
        assert (got[rows] - alone["b" if name == "a" else "a"].logp_B_T[rows]).abs().max() > 1e-2  # the teachers differ
    if loss == "topk_fkl":
        ids = torch.cat([c.topk_ids_B_T_K for c in routed])
        assert torch.equal(ids[[0, 3]], alone["a"].topk_ids_B_T_K[[0, 3]])

    n = float(batch.rollout.completion_mask_B_T.sum())
    m = teachers.finish_metrics(opd_step.micro_losses(cfg.loss, student, batch, routed, nc, teacher_names=("a", "b"),
                                                      **kw), ("a", "b"))
    g_routed = _grads(student)
    g_ref, per = {}, {}
    for name, t, rows in (("a", a, [0, 3]), ("b", b, [1, 2])):
        sub = _rows(batch, rows)
        per[name] = opd_step.micro_losses(one.loss, student, sub, opd_step.score_batch(one.loss, t, sub, nc, **kw_one),
                                          nc, n_tokens=n, **kw_one)
        for k, g in _grads(student).items():
            g_ref[k] = g_ref.get(k, 0) + g
    for k in ("lm_head.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        torch.testing.assert_close(g_routed[k], g_ref[k], rtol=1e-4, atol=1e-7, msg=k)
    for name in ("a", "b"):
        tokens = per[name]["tokens"]
        assert m[f"teacher.{name}.tokens"] == tokens
        assert m[f"teacher.{name}.kl"] == pytest.approx(per[name]["kl"], rel=1e-5, abs=1e-6)
        assert m[f"teacher.{name}.loss"] == pytest.approx(per[name]["loss"] * n / tokens, rel=1e-5, abs=1e-6)
    assert m["loss"] == pytest.approx(per["a"]["loss"] + per["b"]["loss"], rel=1e-5, abs=1e-7)


def _cli(*args, overrides):
    return opdkit_main([*args, "-p", "none", "--quiet", *[x for kv in overrides for x in ("-S", kv)]])


def test_two_teachers_train_with_per_teacher_metrics(fx, teacher2, tmp_path):
    data = _routed_data(fx, tmp_path / "routed.jsonl")
    out = tmp_path / "out"
    rc = _cli("train", "--out", str(out), overrides=[f"student.path={fx / 'student'}", f"data.train={data}",
                                                     *_teachers(fx, teacher2), *TINY, "loss.name=k1",
                                                     "budget.max_steps=2"])
    assert rc == 0
    rows = [json.loads(ln) for ln in (out / "metrics" / "train.jsonl").read_text().splitlines()]
    for r in rows:
        assert r["teacher.a.tokens"] + r["teacher.b.tokens"] == r["tokens"]
        for name in ("a", "b"):
            if r[f"teacher.{name}.tokens"]:
                assert r[f"teacher.{name}.kl"] is not None and r[f"teacher.{name}.loss"] is not None
    assert any(r["teacher.a.tokens"] for r in rows) and any(r["teacher.b.tokens"] for r in rows)


def test_a_row_naming_no_known_teacher_is_refused_before_anything_is_written(fx, teacher2, tmp_path, capsys):
    data = _routed_data(fx, tmp_path / "routed.jsonl", names=("a", "b", "b", "c"))
    out = tmp_path / "out"
    rc = _cli("train", "--out", str(out), overrides=[f"student.path={fx / 'student'}", f"data.train={data}",
                                                     *_teachers(fx, teacher2), *TINY, "budget.max_steps=1"])
    err = capsys.readouterr().err
    assert rc == 2 and not out.exists()
    assert f"data file {data}, row 3" in err and "names teacher 'c'" in err and "a, b" in err


def test_a_teacher_with_another_tokenizer_is_refused_with_the_doctors_message(fx, tmp_path, capsys):
    other = teacher_with_another_vocabulary(fx, tmp_path / "other")
    data = _routed_data(fx, tmp_path / "routed.jsonl")
    pair = [f"student.path={fx / 'student'}", f"data.train={data}", "data.teacher_column=teacher",
            f"teachers=[{{name: a, path: {fx / 'teacher'}}}, {{name: b, path: {other}}}]", *TINY, "budget.max_steps=1"]
    assert _cli("train", "--out", str(tmp_path / "out"), overrides=pair) == 2 and not (tmp_path / "out").exists()
    train_err = capsys.readouterr().err
    assert "teacher and student tokenizers disagree" in train_err and str(other) in train_err
    assert _cli("doctor", overrides=pair) == 1
    table = " ".join(capsys.readouterr().out.split())
    problem = train_err.split("error: ", 1)[1].split("; OPD needs")[0]
    assert "FAIL vocabulary (teacher b)" in table and " ".join(problem.split()) in table


def test_several_teachers_params_are_checked(tmp_path):
    from opdkit.setup import RunError, check_params

    base = replace(Config(), "teachers=[{name: a, path: x}, {name: b, path: y}]", "data.teacher_column=teacher")
    check_params(base)
    for bad, needle in ((("data.teacher_column=",), "both"), (("teacher.path=z",), "both set"),
                        (("teachers=[{name: a, path: x}, {name: a, path: y}]",), "each name once"),
                        (("teacher.source=privileged_fixed",), "student itself"),
                        (("loss.name=sft",), "samples from one teacher"),
                        (("runtime.teacher_sharding=fsdp",), "teacher_sharding=replicate")):
        with pytest.raises(RunError, match=needle):
            check_params(replace(base, *bad))
    with pytest.raises(Exception, match="needs a name and a path"):
        replace(Config(), "teachers=[{name: a}]")


# --- teacher.device ---------------------------------------------------------------------------------


EMB = ("rollout.prompts_per_step=4", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=30", "budget.max_steps=2",
       "budget.max_wall_time_s=0", "optim.schedule=constant", "publish.every_steps=0", "runtime.threads=1")


def test_teacher_device_cpu_is_todays_run_on_a_cpu(tmp_path):
    from safetensors.torch import load_file

    from opdkit.train import train

    weights = {}
    for name, setting in (("plain", ""), ("cpu", "cpu")):
        train(replace(Config(), *EMB, "loss.name=rkl", f"teacher.device={setting}"), tmp_path / name,
              log=lambda *a: None, progress=False)
        weights[name] = load_file(tmp_path / name / "checkpoints" / "checkpoint-2" / "model.safetensors")
    for k, v in weights["plain"].items():
        assert torch.equal(v, weights["cpu"][k]), k


@pytest.mark.parametrize("setting, needle", [("gpu", "expected ''"), ("cuda:x", "expected ''"),
                                             ("cuda:<one past the last>", "CUDA is not available|cuda:0 ..")])
def test_teacher_device_is_validated_before_anything_is_written(tmp_path, setting, needle):
    from opdkit.setup import RunError
    from opdkit.train import train

    # a device index this machine does not have, whatever its GPU count (no skip on an 8-GPU host)
    setting = setting.replace("<one past the last>", str(max(torch.cuda.device_count(), 1)))
    with pytest.raises(RunError, match=needle):
        train(replace(Config(), *EMB, f"teacher.device={setting}"), tmp_path / "x", log=lambda *a: None)
    with pytest.raises(RunError, match="teacher.source=model"):
        train(replace(Config(), *EMB, "teacher.device=cpu", "teacher.source=privileged_fixed"), tmp_path / "x",
              log=lambda *a: None)
    assert not (tmp_path / "x").exists()


def test_a_teacher_elsewhere_scores_the_full_vocabulary_with_a_copy_of_its_head(fx, models, monkeypatch):
    """A teacher on another device hands over its hidden states and a copy of its head (restricted to the
    tokenizer's ids) made on the student's device: the same loss and gradients as its own head."""
    tok, student, a, _ = models
    batch = _batch(fx, tok, student)
    batch.teacher_B = None  # one teacher
    cfg = load_config(None, ["loss.name=rkl", "runtime.logprob_chunk=4"])
    nc = contextlib.nullcontext
    here = opd_step.score_batch(cfg.loss, a, batch, nc, **_settings(cfg))
    m_here = opd_step.micro_losses(cfg.loss, student, batch, here, nc, **_settings(cfg))
    g_here = _grads(student)
    monkeypatch.setattr(teachers, "device_of", lambda t: torch.device("meta"))  # "elsewhere": to_device copies the head
    moved = [teachers.to_device(c, a, CPU) for c in here]
    assert moved[0].head is not unwrap(a)[1] and moved[0].head.weight.shape[0] == len(tok)
    m_moved = opd_step.micro_losses(cfg.loss, student, batch, moved, nc, **_settings(cfg))
    g_moved = _grads(student)
    assert m_moved["loss"] == pytest.approx(m_here["loss"], rel=1e-6)
    assert m_moved["kl"] == pytest.approx(m_here["kl"], rel=1e-6)
    for k in g_here:
        torch.testing.assert_close(g_moved[k], g_here[k], rtol=1e-5, atol=1e-8, msg=k)
    with torch.no_grad():  # the copy is the restricted head: padding rows cut, the same logits on the tokenizer's ids
        h = completion_hidden(a, opd.teacher_geometry(batch))
        ids = batch.rollout.completion_ids_B_T
        torch.testing.assert_close(token_logprobs(moved[0].head, h, ids, 4), token_logprobs(unwrap(a)[1], h, ids, 4))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_teacher_on_the_cpu_beside_a_student_on_the_gpu(tmp_path):
    """The real split: the student on cuda, the teacher on the CPU (fp32 there, bf16 on the GPU)."""
    from opdkit.train import train

    losses_ = {}
    for name, setting in (("gpu", ""), ("cpu", "cpu")):
        train(replace(Config(), *EMB, "loss.name=rkl", f"teacher.device={setting}", "runtime.device=cuda"),
              tmp_path / name, log=lambda *a: None, progress=False)
        rows = (tmp_path / name / "metrics" / "train.jsonl").read_text().splitlines()
        losses_[name] = [json.loads(ln)["loss"] for ln in rows]
    assert losses_["cpu"] == pytest.approx(losses_["gpu"], rel=0.05)
