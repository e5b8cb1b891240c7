"""Evaluation: sample n completions per question, grade them, report clustered error bars.

The protocol (temperature, top_p, token cap, samples per question, seed) comes from ``EvalConfig``;
sample j of question q always gets the seed ``sample_seed(eval.seed, 0, q*n + j)``, so two models
evaluated with the same params see the same random numbers, and a result does not depend on the
batch size.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm.auto import tqdm

from opdkit.config import DataConfig, EvalConfig
from opdkit.data import Example, encode_prompt
from opdkit.grading import grade_many
from opdkit.engines.hf import HFEngine
from opdkit.engines.sampling import sample_seed
from opdkit.stats import clustered_accuracy


def sample_answers(model, tokenizer, examples: list[Example], data: DataConfig, ev: EvalConfig,
                   progress: bool = True) -> list[dict]:
    """One record per (question, sample): ids, completion text, token count, truncated flag."""
    engine = HFEngine(model, tokenizer)
    n = ev.n_samples
    per_call = max(1, ev.batch_size // n)  # questions per generate call
    records = []
    bar = tqdm(total=len(examples), desc="eval", unit="q", disable=not progress)
    for start in range(0, len(examples), per_call):
        chunk = examples[start:start + per_call]
        prompts = [encode_prompt(ex, tokenizer, data) for ex in chunk]
        seeds = [sample_seed(ev.seed, 0, (start + i) * n + j) for i in range(len(chunk)) for j in range(n)]
        ro = engine.sample(prompts, samples_per_prompt=n, seeds=seeds, temperature=ev.temperature,
                           top_p=ev.top_p, max_new_tokens=ev.max_new_tokens)
        lengths = ro.completion_mask_B_T.sum(dim=1).long().tolist()
        for b in range(ro.completion_ids_B_T.shape[0]):
            ex = chunk[b // n]
            ids = ro.completion_ids_B_T[b, : lengths[b]].tolist()
            records.append({
                "id": ex.id, "sample": b % n, "answer": ex.answer,
                "completion": tokenizer.decode(ids, skip_special_tokens=True),
                "n_tokens": lengths[b], "truncated": bool(ro.truncated_B[b]),
            })
        bar.update(len(chunk))
    bar.close()
    return records


def summarize(records: list[dict]) -> dict:
    """The eval JSON of DESIGN.md from graded per-sample records."""
    by_q: dict[str, list[float]] = {}
    for r in records:
        by_q.setdefault(r["id"], []).append(float(r["correct"]))
    acc = clustered_accuracy(by_q)
    return {
        "accuracy": acc["accuracy"], "stderr": acc["stderr"], "stderr_naive": acc["stderr_naive"],
        "n_questions": acc["n_questions"], "n_samples": acc["n_samples"],
        "truncated_frac": sum(r["truncated"] for r in records) / max(1, len(records)),
        "boxed_frac": sum(r["has_box"] for r in records) / max(1, len(records)),
        "mean_response_tokens": sum(r["n_tokens"] for r in records) / max(1, len(records)),
    }


@torch.no_grad()
def evaluate(model, tokenizer, examples: list[Example], data: DataConfig, ev: EvalConfig,
             progress: bool = True) -> tuple[dict, list[dict]]:
    """Sample, grade (in the main thread: math-verify uses signals) and summarise."""
    if ev.max_questions:
        examples = examples[: ev.max_questions]
    records = sample_answers(model, tokenizer, examples, data, ev, progress)
    grades = grade_many([r["completion"] for r in records], [r["answer"] for r in records])
    for r, g in zip(records, grades):
        r.update(pred=g["pred"], correct=bool(g["correct"]), has_box=bool(g["has_box"]))
    return summarize(records), records


def write_eval(summary: dict, records: list[dict], out: str | Path) -> Path:
    """``out`` (JSON summary) and ``out`` with suffix ``.jsonl`` (per-sample records) beside it."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")
    per_q = out.with_suffix(".jsonl")
    with per_q.open("w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return per_q
