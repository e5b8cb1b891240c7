"""Evaluation: sample n completions per question, grade them, report clustered error bars.

The protocol (temperature, top_p, token cap, samples per question, seed, prompt) comes from
``EvalConfig`` (``eval.protocol`` presets fix a seeded run's values: ``opdkit.config.PROTOCOLS``);
sample j of question q always gets the seed ``sample_seed(eval.seed, 0, q*n + j)``, so two models
evaluated with the same params see the same random numbers, and a result does not depend on the
batch size. Grading: the rule grader, then the verifier (``opdkit.grading``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from tqdm.auto import tqdm

from opdkit.config import PROTOCOLS, ConfigError, DataConfig, EvalConfig
from opdkit.data import Example, encode_prompt
from opdkit.engines.hf import HFEngine
from opdkit.engines.sampling import sample_seed
from opdkit.grading import grade_many, normalize_answer
from opdkit.memory import ModelShape, device_memory, free_device_bytes, kv_cache_bytes, layer_activation_bytes, shape_of
from opdkit.stats import clustered_accuracy, majority_vote, pass_at_k

# the share of the memory free once the model and its decoder are in place that one decode call's rows may fill
DECODE_MEMORY_SHARE = {"cuda": 0.8, "cpu": 0.5}  # the CPU's generate grows its cache by copies


def row_bytes(shape: ModelShape, slots: int, prompt_tokens: int, max_new_tokens: int, cache_bytes: int) -> int:
    """Bytes one sequence of a decode call holds (an estimate, as ``opdkit.memory``'s): its KV cache of ``slots``
    positions at ``cache_bytes`` a value (the static decoder's: its prompt slots, ``max_new_tokens`` and one graph's
    steps), its sampled ids and log-probs, three rows of logits in float32 (the raw logits, the sampler's scores
    and their float32 copy), and one layer's activations over the ``prompt_tokens`` while they are prefilled."""
    kv = kv_cache_bytes(shape, slots, cache_bytes)
    out = max_new_tokens * (8 + 4)
    logits = 3 * 4 * shape.rows
    prefill = prompt_tokens * layer_activation_bytes(shape.hidden, shape.kv, shape.intermediate, cache_bytes)
    return kv + out + logits + prefill


def decode_rows(batch_size: int, per_row: int, available: int, share: float, max_new_tokens: int) -> int:
    """Sequences per decode call: ``eval.batch_size`` (``batch_size``), or as many as fill ``share`` of the
    ``available`` bytes at ``per_row`` bytes each (``row_bytes``) where fewer; ``ConfigError`` where not even one
    fits, naming ``eval.max_new_tokens``. (Before, every call took ``batch_size`` rows: the caches of 512 rows x
    12,560 slots of a 1.5B qwen2, math500_proxy's, alone are ~184 GB, more than an H200 has.)"""
    fit = int(share * available) // max(1, per_row)
    if fit < 1:
        raise ConfigError(f"eval: one sequence of eval.max_new_tokens={max_new_tokens} needs ~{per_row / 2**30:.2f} "
                          f"GiB to decode (its KV cache and logits) and {available / 2**30:.2f} GiB are free "
                          f"({share:.0%} of it usable): lower eval.max_new_tokens or free memory")
    return min(batch_size, fit)


def sample_answers(model, tokenizer, examples: list[Example], data: DataConfig, ev: EvalConfig,
                   progress: bool = True, available: int | None = None, log=None,
                   device: torch.device | None = None) -> list[dict]:
    """One record per (question, sample): ids, completion text, token count, truncated flag. ``eval.engine=hf``:
    each decode call takes whole questions' samples, at most ``eval.batch_size`` sequences and no more than fit in
    the memory free once the model and its decoder are in place (``available`` bytes: by default measured on the
    model's device; ``decode_rows``; a question's n samples over several calls where fewer than n fit); the records
    do not depend on how the calls are cut (each sample has its own seed). ``eval.engine=vllm``: every question in
    one call to ``vllm_engine``'s engine, on ``device`` (None: the model's; ``weights_device`` keeps the model on
    the CPU). ``log``: told the rows per call where memory lowers them."""
    prompts_all = [encode_prompt(ex, tokenizer, data) for ex in examples]
    width, n = max((len(p) for p in prompts_all), default=0), ev.n_samples
    if ev.engine == "vllm":
        engine, per_call = vllm_engine(model, tokenizer, ev, width, device), max(1, len(examples))
    else:
        engine = HFEngine(model, tokenizer)
        rows = _rows_that_fit(model, engine, ev, width, available, len(examples) * n, log)
        engine.batch_size = rows if rows < n else 0  # a question's samples split over calls only where they must be
        per_call = max(1, rows // n)  # questions per generate call
    records = []
    bar = tqdm(total=len(examples), desc="eval", unit="q", disable=not progress)
    for start in range(0, len(examples), per_call):
        chunk = examples[start:start + per_call]
        prompts = prompts_all[start:start + per_call]
        seeds = [sample_seed(ev.seed, 0, (start + i) * n + j) for i in range(len(chunk)) for j in range(n)]
        ro = engine.sample(prompts, samples_per_prompt=n, seeds=seeds, temperature=ev.temperature,
                           top_p=ev.top_p, max_new_tokens=ev.max_new_tokens, logprobs=False)
        lengths = ro.completion_mask_B_T.sum(dim=1).long().tolist()
        for b in range(ro.completion_ids_B_T.shape[0]):
            ex = chunk[b // n]
            ids = ro.completion_ids_B_T[b, : lengths[b]].tolist()
            records.append({
                "id": ex.id, "source": ex.source, "sample": b % n, "answer": ex.answer,
                "completion": tokenizer.decode(ids, skip_special_tokens=True),
                "n_tokens": lengths[b], "truncated": bool(ro.truncated_B[b]),
            })
        bar.update(len(chunk))
    bar.close()
    return records


def _accuracy(records: list[dict]) -> dict:
    by_q: dict[str, list[float]] = {}
    for r in records:
        by_q.setdefault(r["id"], []).append(float(r["correct"]))
    return clustered_accuracy(by_q)


def sample_metrics(records: list[dict]) -> dict:
    """With n >= 2 samples of every question: ``pass_at_k`` ({k: value and question-clustered stderr} at k = 2,
    4, 8, ... up to n, and n itself; ``stats.pass_at_k``; pass@1 is ``accuracy``) and ``maj_at_n`` (majority vote
    over each question's extracted answers, normalised as the rule grader compares them; ``stats.majority_vote``).
    Else nothing."""
    by_q: dict[str, list[dict]] = {}
    for r in records:
        by_q.setdefault(r["id"], []).append(r)
    n = min((len(v) for v in by_q.values()), default=0)
    if n < 2:
        return {}
    correct = {q: [r["correct"] for r in v] for q, v in by_q.items()}
    ks = sorted({*(2**i for i in range(1, n.bit_length()) if 2**i <= n), n})
    answers = {q: [(normalize_answer(r["pred"]) if r.get("pred") else "", r["correct"]) for r in v]
               for q, v in by_q.items()}
    passes = (pass_at_k(correct, k) for k in ks)
    return {"pass_at_k": {str(p["k"]): {"value": p["value"], "stderr": p["stderr"]} for p in passes},
            "maj_at_n": {"n": n, **majority_vote(answers)}}


def summarize(records: list[dict]) -> dict:
    """The eval JSON (docs/design.md, "Metrics") from graded per-sample records; ``verifier_frac`` is the share of
    samples that only the verifier accepted. With questions from several sources (AIME 2024 and
    2025), ``parts`` holds each source's accuracy, clustered stderr and counts."""
    acc = _accuracy(records)
    n = max(1, len(records))
    out = {
        "accuracy": acc["accuracy"], "stderr": acc["stderr"], "stderr_naive": acc["stderr_naive"],
        "n_questions": acc["n_questions"], "n_samples": acc["n_samples"],
        "truncated_frac": sum(r["truncated"] for r in records) / n,
        "boxed_frac": sum(r["has_box"] for r in records) / n,
        "verifier_frac": sum(r["graded_by"] == "verifier" for r in records) / n,
        "mean_response_tokens": sum(r["n_tokens"] for r in records) / n,
    }
    out.update(sample_metrics(records))
    sources = sorted({r["source"] for r in records})
    if len(sources) > 1:
        out["parts"] = {}
        for src in sources:
            part = _accuracy([r for r in records if r["source"] == src])
            out["parts"][src] = {k: part[k] for k in ("accuracy", "stderr", "n_questions", "n_samples")}
    return out


def _rows_that_fit(model, engine: HFEngine, ev: EvalConfig, width: int, available: int | None, total: int,
                   log) -> int:
    """``decode_rows`` for ``engine`` and prompts of up to ``width`` tokens (``available``: None = measured)."""
    device, dec = next(model.parameters()).device, engine.decoder
    if dec is not None:  # the static decoder's session: prompt slots in whole blocks, the new tokens, a graph's steps
        slots = -(-width // dec.prompt_slots) * dec.prompt_slots + ev.max_new_tokens + dec.steps_per_graph
        per_row = row_bytes(shape_of(model), slots, width, ev.max_new_tokens, dec.dtype.itemsize)
    else:  # generate's cache, in the model's dtype
        per_row = row_bytes(shape_of(model), width + ev.max_new_tokens, width, ev.max_new_tokens,
                            next(model.parameters()).itemsize)
    if available is None:
        available = free_device_bytes(device) if device.type == "cuda" else device_memory(device)[1]
    rows = decode_rows(ev.batch_size, per_row, available, DECODE_MEMORY_SHARE.get(device.type, 0.5),
                       ev.max_new_tokens)
    if rows < min(ev.batch_size, total) and log is not None:
        log(f"eval: {rows} sequences per decode call, not eval.batch_size={ev.batch_size}: ~{per_row / 2**20:,.0f} "
            f"MiB each (prompt + {ev.max_new_tokens:,} new tokens), {available / 2**30:.1f} GiB free")
    return rows


def check_engine(ev: EvalConfig) -> None:
    """Raise ``ConfigError`` if ``eval.engine`` cannot run here (vllm, not installed): asked before a model loads."""
    from opdkit.engines.vllm import available

    if ev.engine == "vllm" and not available():
        raise ConfigError('eval.engine=vllm needs vLLM: pip install -e ".[vllm]" (docs/scaling_out.md says which '
                          "version matches your torch); or leave eval.engine at hf")


def weights_device(ev: EvalConfig, device: torch.device) -> torch.device:
    """Where ``opdkit eval`` loads the model it evaluates on ``device``: the CPU under ``eval.engine=vllm`` (the
    engine holds its own bf16 copy on ``device``; the HF model is only the source of that copy, and on the GPU it
    would take as much memory again from the engine's KV cache), else ``device`` (the HF engine decodes with it)."""
    return torch.device("cpu") if ev.engine == "vllm" else device


def vllm_engine(model, tokenizer, ev: EvalConfig, prompt_tokens: int, device: torch.device | None = None):
    """``eval.engine=vllm``: the rollouts' vLLM engine (``opdkit.engines.vllm.VLLMEngine``, the padding rows cut
    from its head) on ``device`` (None: ``model``'s) built from ``model``'s own directory with ``model``'s weights
    pushed into it: up to ``eval.batch_size`` sequences decoded at once (continuous batching: a finished sample's
    slot takes the next), ``eval.gpu_memory_utilization`` of the GPU, ``prompt_tokens`` + ``eval.max_new_tokens``
    positions."""
    from opdkit.config import Config, RolloutConfig
    from opdkit.engines.vllm import VLLMEngine

    check_engine(ev)
    rollout = RolloutConfig(engine="vllm", prompts_per_step=ev.batch_size, samples_per_prompt=1,
                            max_new_tokens=ev.max_new_tokens, max_prompt_tokens=max(1, prompt_tokens),
                            gpu_memory_utilization=ev.gpu_memory_utilization)
    engine = VLLMEngine(Config(seed=ev.seed, rollout=rollout), model, tokenizer, device)
    engine.sync_weights(model)
    return engine


@torch.no_grad()
def evaluate(model, tokenizer, examples: list[Example], data: DataConfig, ev: EvalConfig,
             progress: bool = True, log=None, device: torch.device | None = None) -> tuple[dict, list[dict]]:
    """Sample (``sample_answers``; ``log`` and ``device`` as there), grade (in the main thread: math-verify uses
    signals) and summarise. The prompt format is ``eval.prompt_format`` ("" = ``data.prompt_format``), the chat
    template's enable_thinking ``eval.enable_thinking``."""
    if ev.max_questions:
        examples = examples[: ev.max_questions]
    if ev.prompt_format:
        data = dataclasses.replace(data, prompt_format=ev.prompt_format)
    data = dataclasses.replace(data, enable_thinking=ev.enable_thinking)  # the benchmark's, not training's
    records = sample_answers(model, tokenizer, examples, data, ev, progress, log=log, device=device)
    grades = grade_many([r["completion"] for r in records], [r["answer"] for r in records])
    for r, g in zip(records, grades):
        r.update(pred=g["pred"], correct=bool(g["correct"]), has_box=bool(g["has_box"]), graded_by=g["graded_by"])
    return summarize(records), records


def protocol_record(ev: EvalConfig, n_questions: int) -> dict:
    """What the eval JSON records about the protocol: the eval params that define the measurement and,
    for a preset, whether this evaluation is a complete one (every question of its benchmark)."""
    keys = ("protocol", "n_samples", "temperature", "top_p", "max_new_tokens", "seed", "prompt_format",
            "enable_thinking", "engine")
    out: dict = {"eval_params": {k: getattr(ev, k) for k in keys}}
    if ev.protocol in PROTOCOLS:
        expected = PROTOCOLS[ev.protocol].n_questions
        out.update(protocol=ev.protocol, protocol_questions=expected,
                   protocol_complete=n_questions == expected and not ev.max_questions)
    return out


# The eval JSON's own fields (summarize, protocol_record, and the model and data `opdkit eval` adds): a --tag of one
# of them would replace the measurement it records
RESULT_KEYS = ("accuracy", "stderr", "stderr_naive", "n_questions", "n_samples", "truncated_frac", "boxed_frac",
               "verifier_frac", "mean_response_tokens", "pass_at_k", "maj_at_n", "parts", "eval_params", "protocol",
               "protocol_questions", "protocol_complete", "model", "data")


def parse_tags(tags: list[str]) -> dict[str, str]:
    """``opdkit eval --tag KEY=VALUE`` arguments as fields of the eval JSON; ``ConfigError`` for one without
    ``=`` or a key, or whose key is one of ``RESULT_KEYS`` (checked before anything is evaluated)."""
    out: dict[str, str] = {}
    for tag in tags:
        key, eq, value = tag.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--tag {tag!r}: expected KEY=VALUE (e.g. --tag arm=k1 --tag seed=0)")
        if key.strip() in RESULT_KEYS:
            raise ConfigError(f"--tag {tag!r}: {key.strip()!r} is a field the eval JSON records itself (one of "
                              f"{', '.join(RESULT_KEYS)}); a tag would replace it: choose another key")
        out[key.strip()] = value
    return out


def check_out(out: str | Path) -> None:
    """``ConfigError`` when ``write_eval`` could not write ``out`` or its ``.jsonl`` beside it because one of
    them is a directory (checked before the evaluation, which it would end with a traceback)."""
    for path in (Path(out), Path(out).with_suffix(".jsonl")):
        if path.is_dir():
            raise ConfigError(f"--out {out}: {path} is a directory; expected the eval JSON's file (FILE.json, its "
                              "per-sample records written beside it as FILE.jsonl)")


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
