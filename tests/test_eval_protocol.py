"""Evaluation protocols (eval.protocol): the seeded runs' presets, how they combine with the other layers, and
the eval JSON's protocol record and per-source parts (AIME 2024 / 2025 in their public files' shapes)."""

import json
import math

import pyarrow.parquet as pq
import pytest
import yaml

from opdkit.config import ConfigError, config_from_dict, load_config
from opdkit.embedded import asset
from opdkit.evaluate import protocol_record, summarize

# written from the seeds: 000/002 (math500_pass_at_1: 500 MATH-500 questions x 4, temperature 0.7, top_p 0.9,
# 12,288 new tokens, generation seed 42; aime24_25_at32: 60 AIME 2024 + 2025 questions x 32, 31,744 tokens, "the
# same prompt family", the other settings the proxy's), 003/004 (AIME24 avg@12: 30 questions x 12, seed 20260610)
SEEDED = {
    "math500_proxy": ({"n_samples": 4, "temperature": 0.7, "top_p": 0.9, "max_new_tokens": 12288, "seed": 42}, 500),
    "aime_final": ({"n_samples": 32, "temperature": 0.7, "top_p": 0.9, "max_new_tokens": 31744, "seed": 42}, 60),
    "aime24_avg12": ({"n_samples": 12, "seed": 20260610}, 30),
}


@pytest.mark.parametrize("name", list(SEEDED))
def test_each_preset_is_its_seeded_protocol_in_the_resolved_config(name, tmp_path):
    fixed, questions = SEEDED[name]
    cfg = config_from_dict({}, [f"eval.protocol={name}"])
    assert {k: getattr(cfg.eval, k) for k in fixed} == fixed
    assert protocol_record(cfg.eval, questions)["protocol_complete"] is True
    assert protocol_record(cfg.eval, questions - 1)["protocol_complete"] is False
    # a params file's own eval values give way to the preset (params.yaml lists every eval key)
    p = tmp_path / "params.yaml"
    p.write_text(yaml.safe_dump({"eval": {"protocol": name, "n_samples": 7, "seed": 1, "batch_size": 16}}))
    cfg = load_config(p)
    assert {k: getattr(cfg.eval, k) for k in fixed} == fixed and cfg.eval.batch_size == 16  # batch_size is free
    # ... but a -S that contradicts it is another measurement, said so
    want = rf"'eval.n_samples': eval.protocol={name} fixes it at {fixed['n_samples']}.*custom"
    with pytest.raises(ConfigError, match=want):
        config_from_dict({}, [f"eval.protocol={name}", "eval.n_samples=3"])
    assert config_from_dict({}, [f"eval.protocol={name}", f"eval.n_samples={fixed['n_samples']}"]).eval == \
        config_from_dict({}, [f"eval.protocol={name}"]).eval


def test_custom_keeps_the_values_and_the_avg12_preset_leaves_unfixed_keys_free():
    custom = config_from_dict({}, ["eval.n_samples=3", "eval.max_new_tokens=9"]).eval
    assert (custom.protocol, custom.n_samples, custom.max_new_tokens) == ("custom", 3, 9)
    assert protocol_record(custom, 5) == {"eval_params": {"protocol": "custom", "n_samples": 3, "temperature": 0.7,
                                                          "top_p": 0.9, "max_new_tokens": 9, "seed": 1234,
                                                          "prompt_format": "", "enable_thinking": True,
                                                          "engine": "hf"}}
    ev = config_from_dict({}, ["eval.protocol=aime24_avg12", "eval.temperature=0.6", "eval.max_new_tokens=100"]).eval
    assert (ev.temperature, ev.max_new_tokens, ev.n_samples, ev.prompt_format) == (0.6, 100, 12, "opsd_eval")
    # a preset switched back to custom keeps its values as custom ones
    back = config_from_dict({"eval": {"protocol": "math500_proxy"}}, ["eval.protocol=custom", "eval.n_samples=8"]).eval
    assert (back.n_samples, back.max_new_tokens) == (8, 64)


def test_parts_are_each_sources_clustered_accuracy():
    """Two sources, questions with unequal sample counts; the expected numbers by hand."""
    rows = [("a1", "2024", [1, 1, 0, 0]), ("a2", "2024", [1, 1, 1, 1]), ("a3", "2024", [0, 0, 0, 0]),
            ("b1", "2025", [1, 0]), ("b2", "2025", [0, 0])]
    records = [{"id": q, "source": src, "correct": bool(c), "truncated": False, "has_box": True,
                "graded_by": "rule" if c else None, "n_tokens": 5} for q, src, cs in rows for c in cs]
    out = summarize(records)
    # 2024: question means 0.5, 1, 0 -> 0.5, sd 0.5 -> se 0.5/sqrt(3); 2025: 0.5, 0 -> 0.25, sd sqrt(0.125) -> se 0.25
    assert out["parts"]["2024"] == pytest.approx({"accuracy": 0.5, "stderr": 0.5 / math.sqrt(3), "n_questions": 3,
                                                  "n_samples": 12})
    assert out["parts"]["2025"] == pytest.approx({"accuracy": 0.25, "stderr": 0.25, "n_questions": 2, "n_samples": 4})
    assert out["accuracy"] == pytest.approx((0.5 + 1 + 0 + 0.5 + 0) / 5) and out["verifier_frac"] == 0
    assert "parts" not in summarize([r for r in records if r["source"] == "2024"])  # one source: no parts


def test_the_summary_has_pass_at_k_and_the_majority_vote_where_every_question_has_several_samples():
    """Three questions x 4 samples: pass@2 and pass@4 by hand; the majority vote over the extracted answers (a
    question whose samples gave no answer scores 0); one sample a question: neither."""
    rows = [("q1", ["4", "4", "5", None], [1, 1, 0, 0]), ("q2", ["2", "3", "3", "3"], [1, 0, 0, 0]),
            ("q3", [None, None, None, None], [0, 0, 0, 0])]
    records = [{"id": q, "source": "s", "pred": p, "correct": bool(c), "truncated": False, "has_box": p is not None,
                "graded_by": "rule" if c else None, "n_tokens": 5} for q, ps, cs in rows for p, c in zip(ps, cs)]
    out = summarize(records)
    # pass@2: q1 1 - C(2,2)/C(4,2) = 5/6, q2 1 - C(3,2)/C(4,2) = 1/2, q3 0; pass@4: 1, 1, 0
    assert out["pass_at_k"]["2"]["value"] == pytest.approx((5 / 6 + 1 / 2) / 3)
    assert out["pass_at_k"]["4"]["value"] == pytest.approx(2 / 3) and set(out["pass_at_k"]) == {"2", "4"}
    assert out["maj_at_n"]["n"] == 4 and out["maj_at_n"]["value"] == pytest.approx(1 / 3)  # q1's "4"; q2's "3" wrong
    assert "pass_at_k" not in summarize([r | {"id": f"{r['id']}-{i}"} for i, r in enumerate(records)])  # n = 1


def test_opdkit_eval_on_aime_2024_and_2025_files_reports_both_parts(tmp_path, capsys, monkeypatch):
    """The embedded eval questions written as the public AIME files are (Maxwell-Jia/AIME_2024:
    ID/Problem/Solution/Answer; opencompass/AIME2025: question/answer), evaluated in one run."""
    rows = pq.read_table(asset("eval")).to_pylist()[:6]
    a24 = tmp_path / "aime_2024.jsonl"
    a24.write_text("".join(json.dumps({"ID": f"2024-I-{i + 1}", "Problem": r["prompt"], "Solution": r["solution"],
                                       "Answer": int(r["answer"])}) + "\n" for i, r in enumerate(rows[:4])))
    a25 = tmp_path / "aime2025.jsonl"
    a25.write_text("".join(json.dumps({"question": r["prompt"], "answer": r["answer"]}) + "\n" for r in rows[4:]))
    out = tmp_path / "eval.json"
    from opdkit.cli import main

    # the CLI's own entry point (`python -m opdkit` is `raise SystemExit(main())`), in this process: a fresh
    # interpreter would spend seconds importing torch
    monkeypatch.chdir(tmp_path)
    code = main(["eval", "--model", str(asset("teacher")), "--data", str(a24), "--data", str(a25), "--out", str(out),
                 "-p", "none", "--quiet", "-S", "eval.n_samples=2", "-S", "eval.max_new_tokens=40",
                 "-S", "runtime.threads=1"])
    assert code == 0, capsys.readouterr().err[-2000:]
    summary = json.loads(out.read_text())
    assert summary["data"] == [str(a24), str(a25)] and summary["n_questions"] == 6
    records = [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()]
    assert {r["id"] for r in records if r["source"] == "aime_2024"} == {f"aime_2024/2024-I-{i}" for i in range(1, 5)}
    for src, n in (("aime_2024", 4), ("aime2025", 2)):
        by_q = {}
        for r in records:
            if r["source"] == src:
                by_q.setdefault(r["id"], []).append(r["correct"])
        assert summary["parts"][src]["n_questions"] == n
        assert summary["parts"][src]["accuracy"] == pytest.approx(sum(sum(v) / len(v) for v in by_q.values()) / n)
    assert summary["accuracy"] > 0.5  # the embedded teacher answers them (the rows were read right)
