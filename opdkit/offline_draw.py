"""``opdkit offline-rollouts``: draw an offline pool (``opdkit.offline``) once, scored by the teacher.

    opdkit offline-rollouts --policy DIR --out FILE.parquet [--prompts N] [--topk K] [-p params] [-S k=v]

The policy (``--policy``, default the params' student) samples the prompts the online run of the
params' seed would draw in its first N / P steps (N = ``--prompts``, default ``rollout.prompts_per_step``
x ``budget.max_steps``: one pass of that run), P = ``rollout.prompts_per_step`` at a time with that
run's per-sample seeds and rollout settings, through the engine training would use (``rollout.engine``);
the teacher (``teacher.path``, a model: ``teacher.source=model``) scores each batch as the training
step scores it (``step.score_batch``, micro-batched as ``optim.micro_batch``): each sampled token's
log-prob and, with ``--topk K`` (default ``loss.topk`` where ``loss.name`` reads the teacher's
top-K, else none), its top-K. So a pool drawn by the run's own student with its seed is, token for
token, what that run draws and scores while its rollout weights are those of step 0.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from opdkit import loss_table, offline, opd, step as opd_step
from opdkit.config import Config, replace
from opdkit.data import prompt_indices
from opdkit.engines.select import engine_name, make_engine
from opdkit.setup import RunError, build_run, code_revision, prepare_inputs


def _scoring_config(cfg: Config, topk: int) -> Config:
    """``cfg`` with a loss whose teacher need is what the pool stores: sampled-token log-probs (k1),
    plus the top-``topk`` (topk_fkl at loss.topk = topk)."""
    return replace(cfg, "loss.name=topk_fkl", f"loss.topk={topk}") if topk else replace(cfg, "loss.name=k1")


def draw_pool(cfg: Config, policy: str | None, out: str | Path, n_prompts: int = 0, topk: int | None = None,
              log=print, progress: bool = True) -> dict:
    """Draw and score the pool (module docstring) and write it to ``out``; returns its metadata."""
    if cfg.teacher.source != "model" or cfg.teachers:
        raise RunError("opdkit offline-rollouts scores with one teacher model (teacher.source=model, no 'teachers')")
    pcfg = replace(cfg, *([f"student.path={policy}"] if policy else []), "rollout.source=live", "rollout.overlap=0",
                   "loss.reward_weight=0")
    if topk is None:
        topk = cfg.loss.topk if loss_table.teacher_need(cfg.loss, cfg.rollout) == "topk" else 0
    P, G, R = cfg.rollout.prompts_per_step, cfg.rollout.samples_per_prompt, cfg.rollout
    n = n_prompts or P * cfg.budget.max_steps
    if n <= 0:
        raise RunError("offline-rollouts: how many prompts? --prompts N, or budget.max_steps > 0 (N = "
                       "rollout.prompts_per_step x budget.max_steps)")
    inputs = prepare_inputs(pcfg)
    if n > len(inputs.examples):
        raise RunError(f"offline-rollouts: --prompts {n} is more than the {len(inputs.examples)} training rows; a pool "
                       "holds each row once (a run walks it epoch after epoch)")
    run = build_run(pcfg, inputs, log)
    run.student.requires_grad_(False)
    engine = make_engine(pcfg, run.student, run.tokenizer)
    engine.sync_weights(run.student)
    scfg = _scoring_config(pcfg, topk)
    rows = prompt_indices(cfg.seed, len(inputs.examples), 0, n, cfg.data.order)
    records, secs = [], {"rollout": 0.0, "score": 0.0}
    for start in tqdm(range(0, n, P), desc="offline-rollouts", unit="step", disable=not progress):
        step_rows = rows[start:start + P]
        examples = [inputs.examples[i] for i in step_rows]
        prompts = run.prompts(examples)
        seeds = opd.step_seeds(cfg.seed, start // P, len(examples) * G)  # the online run's seeds of this step
        t0 = time.monotonic()
        with run.autocast():
            ro = engine.sample(prompts, samples_per_prompt=G, seeds=seeds, temperature=R.temperature, top_p=R.top_p,
                               max_new_tokens=R.max_new_tokens, logprobs=True)
        t1 = time.monotonic()
        batch = opd.Batch(ro, ro.prompt_ids_B_Sp, ro.prompt_mask_B_Sp, cfg.data.pad_side)
        contexts = opd_step.score_batch(scfg.loss, run.teacher, batch, run.autocast, rollout=scfg.rollout,
                                        runtime=scfg.runtime, micro_batch=scfg.optim.micro_batch)
        secs["rollout"] += t1 - t0
        secs["score"] += time.monotonic() - t1
        ctx = {k: torch.cat([getattr(c, k) for c in contexts]).cpu()
               for k in ("logp_B_T", "topk_ids_B_T_K", "topk_logp_B_T_K") if getattr(contexts[0], k) is not None}
        lengths = ro.completion_mask_B_T.sum(1).long().tolist()
        for b, length in enumerate(lengths):
            i = b // G  # prompt-major rows
            rec = {"prompt_index": start + i, "row": step_rows[i], "sample": b % G, "seed": seeds[b],
                   "example_id": examples[i].id, "prompt_ids": prompts[i],
                   "completion_ids": ro.completion_ids_B_T[b, :length].tolist(), "truncated": bool(ro.truncated_B[b]),
                   "behaviour_logp": ro.sampling_logp_B_T[b, :length].tolist(),
                   "teacher_logp": ctx["logp_B_T"][b, :length].tolist()}
            if topk:
                rec["teacher_topk_ids"] = ctx["topk_ids_B_T_K"][b, :length].tolist()
                rec["teacher_topk_logp"] = ctx["topk_logp_B_T_K"][b, :length].tolist()
            records.append(rec)
    meta = {
        "n_prompts": n, "samples_per_prompt": G, "temperature": R.temperature, "top_p": R.top_p,
        "max_new_tokens": R.max_new_tokens, "topk": topk, "seed": cfg.seed, "data_order": cfg.data.order,
        "prompts_per_step": P, "policy": str(inputs.student_path),
        "policy_fingerprint": offline.model_fingerprint(inputs.student_path), "teacher": str(inputs.teacher_path),
        "teacher_fingerprint": offline.model_fingerprint(inputs.teacher_path), "data": str(inputs.train_path),
        "data_fingerprint": inputs.data_fingerprint, "prompt_format": cfg.data.prompt_format,
        "chat_template": cfg.data.chat_template, "engine": engine_name(pcfg, run.device), "device": str(run.device),
        "dtype": str(run.dtype).replace("torch.", ""), "seconds": {k: round(v, 3) for k, v in secs.items()},
        "tokens": sum(len(r["completion_ids"]) for r in records), "code_revision": code_revision(),
    }
    offline.write_pool(out, records, meta)
    log(f"wrote {out}: {n} prompts x {G} samples ({meta['tokens']:,} tokens) of {meta['policy']}, drawn in "
        f"{secs['rollout']:.1f}s and scored by {meta['teacher']} in {secs['score']:.1f}s"
        + (f", teacher top-{topk} stored" if topk else ""))
    return meta
