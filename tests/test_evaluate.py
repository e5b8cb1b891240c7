"""End-to-end evaluation of the shipped embedded teacher and student (small slice of the eval split)."""

import json

import pytest
import torch

from opdkit import paths
from opdkit.config import Config, ConfigError, replace
from opdkit.data import load_examples
from opdkit.evaluate import RESULT_KEYS, evaluate, parse_tags, protocol_record, summarize
from opdkit.models import load_model, load_tokenizer


@pytest.fixture(scope="module")
def cfg():
    return replace(Config(), "eval.max_questions=48", "eval.n_samples=2", "runtime.threads=1")


def _eval(cfg, which):
    torch.set_num_threads(1)
    path = paths.teacher_path(cfg) if which == "teacher" else paths.student_path(cfg)
    model, tok = load_model(path, torch.device("cpu")), load_tokenizer(path)
    return evaluate(model, tok, load_examples(paths.eval_data_path(cfg), cfg.data), cfg.data, cfg.eval, progress=False)


def test_teacher_is_clearly_better_than_student(cfg):
    t, t_rec = _eval(cfg, "teacher")
    s, s_rec = _eval(cfg, "student")
    assert t["n_questions"] == s["n_questions"] == 48 and t["n_samples"] == 96
    assert t["accuracy"] >= 0.85 and s["accuracy"] <= 0.6, (t, s)
    assert t["accuracy"] - s["accuracy"] > 3 * (t["stderr"] ** 2 + s["stderr"] ** 2) ** 0.5
    # the summary is recomputed independently from the per-sample records
    by_q = {}
    for r in s_rec:
        by_q.setdefault(r["id"], []).append(r["correct"])
    means = [sum(v) / len(v) for v in by_q.values()]
    assert s["accuracy"] == pytest.approx(sum(means) / len(means))
    assert summarize(s_rec) == s
    assert all(r["pred"] == r["answer"] for r in t_rec if r["correct"])


def test_eval_cli_writes_json_and_jsonl(tmp_path, cfg):
    out = tmp_path / "e" / "teacher.json"
    from opdkit.cli import main

    # the CLI's own entry point (`python -m opdkit` is `raise SystemExit(main())`), in this process: a fresh
    # interpreter would spend seconds importing torch
    argv = ["eval", "--quiet", "--model", str(paths.teacher_path(cfg)), "--out", str(out), "--tag", "arm=teacher",
            "-S", "eval.max_questions=8", "-S", "eval.n_samples=2", "-S", "runtime.threads=1"]
    assert main(argv) == 0
    summary = json.loads(out.read_text())
    for key in ("accuracy", "stderr", "n_questions", "n_samples", "truncated_frac"):
        assert key in summary
    assert summary["n_questions"] == 8 and summary["n_samples"] == 16 and summary["arm"] == "teacher"
    lines = out.with_suffix(".jsonl").read_text().splitlines()
    assert len(lines) == 16 and {"id", "completion", "correct", "truncated"} <= set(json.loads(lines[0]))


def test_a_tag_may_not_replace_what_the_eval_json_measures(tmp_path, cfg, capsys):
    """--tag accuracy=0.99 replaced the measured accuracy and --tag arm (no '=') wrote arm "" without a word; both
    are refused before anything is evaluated (exit 2, nothing written). RESULT_KEYS holds every field the eval
    JSON writes of its own."""
    assert parse_tags(["arm=k1", "seed=0", "note=a=b"]) == {"arm": "k1", "seed": "0", "note": "a=b"}
    with pytest.raises(ConfigError, match=r"--tag 'accuracy=0.99': 'accuracy' is a field the eval JSON records"):
        parse_tags(["arm=k1", "accuracy=0.99"])
    with pytest.raises(ConfigError, match=r"--tag 'arm': expected KEY=VALUE"):
        parse_tags(["arm"])
    records = [{"id": q, "source": src, "correct": True, "truncated": False, "has_box": True, "graded_by": "rule",
                "n_tokens": 3} for q, src in (("a", "2024"), ("b", "2025"))]
    assert set(summarize(records)) | set(protocol_record(Config().eval, 2)) | {"model", "data"} <= set(RESULT_KEYS)
    assert set(protocol_record(replace(Config(), "eval.protocol=aime_final").eval, 2)) <= set(RESULT_KEYS)
    from opdkit.cli import main

    out = tmp_path / "e.json"
    assert main(["eval", "--quiet", "--model", str(paths.teacher_path(cfg)), "--out", str(out), "--tag",
                 "n_questions=300"]) == 2
    assert capsys.readouterr().err.startswith("opdkit: error: --tag 'n_questions=300'") and not out.exists()


def test_an_out_that_is_a_directory_is_refused_before_evaluating(tmp_path, cfg, capsys):
    """'opdkit eval --out DIR' evaluated every question, then ended in an IsADirectoryError traceback (exit 1)."""
    from opdkit.cli import main

    (tmp_path / "e").mkdir()
    assert main(["eval", "--quiet", "--model", str(paths.teacher_path(cfg)), "--out", str(tmp_path / "e")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"opdkit: error: --out {tmp_path / 'e'}: {tmp_path / 'e'} is a directory"), err
    assert err.count("\n") == 1 and list(tmp_path.iterdir()) == [tmp_path / "e"]


def test_a_decode_call_holds_what_the_static_decoders_session_allocates_per_row():
    """``row_bytes``' KV term is the static decoder's cache per row (``static._Session``: keys and values of
    (B, kv heads, prompt slots + new tokens + 64, head size) per layer), counted here from tensors of those
    shapes on the meta device; at the 1.5B qwen2 shape and math500_proxy's 12,288 new tokens, 512 rows' caches
    alone take ~184 GB, so an H200's ~130 free GB take fewer rows per call."""
    from opdkit.evaluate import decode_rows, row_bytes
    from opdkit.memory import ModelShape

    shape = ModelShape(params=1_777_088_000, trainable=1_777_088_000, layers=28, hidden=1536, kv=2 * 128,
                       intermediate=8960, rows=151_936)
    prompt, new = 240, 12_288
    slots = 256 + new + 16  # the session's: prompt slots in blocks of 256, the new tokens, a graph's 16 steps
    per_row = row_bytes(shape, slots, prompt, new, cache_bytes=2)
    one = torch.zeros((1, 2, slots, 128), dtype=torch.bfloat16, device="meta")
    kv = 2 * shape.layers * one.untyped_storage().nbytes()
    assert kv == 2 * 28 * 2 * 12_560 * 128 * 2
    assert kv < per_row < 1.15 * kv  # the cache is most of a row: one layer's prefill (~8%), logits and ids the rest
    assert 512 * kv > 184e9 and 512 * per_row < 205e9
    rows = decode_rows(512, per_row, available=130 * 2**30, share=0.8, max_new_tokens=new)
    assert rows == int(0.8 * 130 * 2**30) // per_row and 250 < rows < 512
    assert decode_rows(512, per_row, available=2**50, share=0.8, max_new_tokens=new) == 512  # the cap
    with pytest.raises(ConfigError, match=r"max_new_tokens=12288 needs ~0\.3\d GiB .* lower eval\.max_new_tokens"):
        decode_rows(512, per_row, available=2**28, share=0.8, max_new_tokens=new)


def test_eval_cuts_its_decode_calls_to_the_memory_free_and_samples_the_same(cfg):
    """Where fewer rows fit than eval.batch_size (here 3 of a question's 4 samples), the calls are cut (a
    question's samples over two calls) and every record is the same as with all rows in one call: each
    sample has its own seed."""
    from opdkit.data import encode_prompt
    from opdkit.evaluate import DECODE_MEMORY_SHARE, row_bytes, sample_answers
    from opdkit.memory import shape_of

    torch.set_num_threads(1)
    path = paths.student_path(cfg)
    model, tok = load_model(path, torch.device("cpu")), load_tokenizer(path)
    ev = replace(cfg, "eval.n_samples=4").eval
    examples = load_examples(paths.eval_data_path(cfg), cfg.data)[:5]
    whole = sample_answers(model, tok, examples, cfg.data, ev, progress=False, available=2**50)
    width = max(len(encode_prompt(ex, tok, cfg.data)) for ex in examples)
    per_row = row_bytes(shape_of(model), width + ev.max_new_tokens, width, ev.max_new_tokens, cache_bytes=4)
    lines = []
    cut = sample_answers(model, tok, examples, cfg.data, ev, progress=False,
                         available=int(3.5 * per_row / DECODE_MEMORY_SHARE["cpu"]), log=lines.append)
    assert lines and lines[0].startswith("eval: 3 sequences per decode call, not eval.batch_size=512")
    assert cut == whole and len(whole) == 20


@pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_eval_through_vllm_without_vllm_says_what_to_install(cfg):
    from opdkit.evaluate import sample_answers

    path = paths.student_path(cfg)
    model, tok = load_model(path, torch.device("cpu")), load_tokenizer(path)
    examples = load_examples(paths.eval_data_path(cfg), cfg.data)[:2]
    with pytest.raises(ConfigError, match=r"eval\.engine=vllm needs vLLM: pip install -e \"\.\[vllm\]\".*at hf"):
        sample_answers(model, tok, examples, cfg.data, replace(cfg, "eval.engine=vllm").eval, progress=False)


@pytest.mark.skipif(__import__("importlib").util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_opdkit_eval_refuses_the_vllm_engine_without_vllm_before_loading_a_model(tmp_path, cfg, monkeypatch, capsys):
    """The check ran inside the sampling, after the model had loaded (minutes at a real shape)."""
    import opdkit.models
    from opdkit.cli import main

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before eval.engine was checked")

    monkeypatch.setattr(opdkit.models, "load_model", no_load)
    rc = main(["eval", "--model", str(paths.student_path(cfg)), "--out", str(tmp_path / "e.json"), "-p", "none",
               "--quiet", "-S", "eval.engine=vllm"])
    assert rc == 2 and "eval.engine=vllm needs vLLM" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_quiet_eval_draws_no_progress_bar_at_all(tmp_path, cfg):
    """``--quiet`` meant no progress bars, yet transformers drew its "Loading weights" bar (a fresh process:
    transformers reads the switch when it is imported)."""
    import subprocess
    import sys

    argv = [sys.executable, "-m", "opdkit", "eval", "--quiet", "--model", str(paths.student_path(cfg)), "--out",
            str(tmp_path / "s.json"), "-p", "none", "-S", "eval.max_questions=2", "-S", "eval.n_samples=1"]
    import os
    from pathlib import Path

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}  # this tree's opdkit
    env.pop("HF_HUB_DISABLE_PROGRESS_BARS", None)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Loading weights" not in done.stderr and "it/s" not in done.stderr, done.stderr[-2000:]


def test_the_vllm_engine_is_the_only_copy_of_the_weights_on_the_evaluating_device(tmp_path, cfg, monkeypatch):
    """``opdkit eval -S eval.engine=vllm`` loaded the model onto the GPU and built the engine from it: two copies of
    the weights there, the HF one unused once pushed (at 7B, ~15 GB less for the engine's KV cache). Now the model
    loads on the CPU (``weights_device``) and the engine is told the device the run picked. Here the picked device
    is a stand-in (``meta``) and the engine a recording stand-in sampling through the HF engine on the CPU."""
    import opdkit.evaluate
    import opdkit.models
    from opdkit.cli import main
    from opdkit.engines.hf import HFEngine
    from opdkit.evaluate import weights_device

    assert weights_device(replace(cfg, "eval.engine=vllm").eval, torch.device("meta")) == torch.device("cpu")
    assert weights_device(cfg.eval, torch.device("meta")) == torch.device("meta")  # the HF engine decodes with it
    seen = {}

    def engine(model, tok, ev, width, device=None):
        seen.update(model=next(model.parameters()).device, engine=device, dtype=next(model.parameters()).dtype)
        return HFEngine(model, tok)

    monkeypatch.setattr(opdkit.evaluate, "check_engine", lambda ev: None)  # vLLM is not installed here
    monkeypatch.setattr(opdkit.evaluate, "vllm_engine", engine)
    monkeypatch.setattr(opdkit.models, "pick_device", lambda rt: torch.device("meta"))
    monkeypatch.setattr(opdkit.models, "compute_dtype", lambda rt, device: torch.bfloat16)  # as on a GPU
    out = tmp_path / "e.json"
    rc = main(["eval", "--model", str(paths.student_path(cfg)), "--out", str(out), "-p", "none", "--quiet",
               "-S", "eval.engine=vllm", "-S", "eval.max_questions=2", "-S", "eval.n_samples=1",
               "-S", "eval.max_new_tokens=4", "-S", "runtime.threads=1"])
    assert rc == 0 and json.loads(out.read_text())["n_samples"] == 2
    assert seen == {"model": torch.device("cpu"), "engine": torch.device("meta"), "dtype": torch.bfloat16}
