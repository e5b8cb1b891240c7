"""The OPD training loop: one flat loop, top to bottom.

Output directory layout (the same for ``opdkit train --out DIR`` and run.sh's ``OUTPUT_DIR``)::

    config.yaml                       the resolved params of the latest start
    checkpoints/checkpoint-<step>/    complete HF exports, published atomically (newest publish.keep)
    metrics/train.jsonl               one JSON object per step
    state/trainer_state.pt            what resume needs (weights or adapter, optimizer, step, data
                                      position, RNG, elapsed wall time); written atomically
    run.json                          how the latest start ended (status, reason, step, checkpoints)

Starting again on the same directory resumes from ``state/``: the step count continues, metrics
lines past the saved step (from a crashed attempt) are dropped and new ones appended, and the
wall-clock budget counts the time already spent.
"""

from __future__ import annotations

import io
import json
import random
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from opdkit import opd
from opdkit.config import Config, dump_yaml, to_dict
from opdkit.fsutil import OutputLock, atomic_write_bytes, atomic_write_json, atomic_write_text, retry_io
from opdkit.publish import Publisher, list_checkpoints, surviving_checkpoints_message
from opdkit.rollout import make_engine
from opdkit.schedules import lr_at
from opdkit.setup import (Run, build_run, code_revision, export_state_dict, load_trainable_state, prepare_inputs,
                          trainable_state, update_ema)

STATE_FILE = "state/trainer_state.pt"
METRICS_FILE = "metrics/train.jsonl"


@dataclass
class TrainResult:
    status: str  # "completed"
    reason: str  # "step_horizon" | "wall_clock"
    step: int
    elapsed_s: float
    checkpoints: list[str]


def prompt_indices(seed: int, n_rows: int, start: int, count: int) -> list[int]:
    """Rows ``start .. start+count-1`` of the data stream: a fresh seeded shuffle per epoch."""
    out, perms = [], {}
    for pos in range(start, start + count):
        epoch, i = divmod(pos, n_rows)
        if epoch not in perms:
            perms[epoch] = random.Random(f"{seed}/epoch/{epoch}").sample(range(n_rows), n_rows)
        out.append(perms[epoch][i])
    return out


def _save_state(out: Path, run: Run, step: int, elapsed: float, data_pos: int) -> None:
    state = {
        "step": step, "elapsed_s": elapsed, "data_pos": data_pos,
        "model": trainable_state(run.student), "optimizer": run.optimizer.state_dict(),
        "ema": {k: v.cpu() for k, v in run.ema.state_dict().items()} if run.ema is not None else None,
        "rng": torch.get_rng_state(), "config": to_dict(run.cfg),
    }
    buf = io.BytesIO()
    torch.save(state, buf)
    (out / STATE_FILE).parent.mkdir(parents=True, exist_ok=True)
    p = run.cfg.publish
    retry_io(lambda: atomic_write_bytes(out / STATE_FILE, buf.getvalue()), retries=p.retries, backoff_s=p.backoff_s,
             what=f"trainer state at step {step}")


def _resume(out: Path, run: Run, log) -> tuple[int, float, int]:
    f = out / STATE_FILE
    if not f.exists():
        return 0, 0.0, 0
    state = torch.load(f, map_location="cpu", weights_only=False)
    load_trainable_state(run.student, state["model"])
    run.optimizer.load_state_dict(state["optimizer"])
    if run.ema is not None and state.get("ema"):
        run.ema.load_state_dict(state["ema"])
    torch.set_rng_state(state["rng"])
    step, elapsed = state["step"], state["elapsed_s"]
    # Drop metrics lines a crashed attempt wrote after the saved step, then append from here.
    mfile = out / METRICS_FILE
    if mfile.exists():
        kept = [ln for ln in mfile.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
        atomic_write_text(mfile, "".join(ln + "\n" for ln in kept))
    log(f"resuming from {f}: step {step}, {elapsed:.1f}s of the wall budget already spent")
    return step, elapsed, state["data_pos"]


def _publish(publisher: Publisher, run: Run, step: int, elapsed: float) -> None:
    meta = {
        "step": step, "elapsed_s": round(elapsed, 3), "params": to_dict(run.cfg),
        "data_fingerprint": run.inputs.data_fingerprint, "data_path": str(run.inputs.train_path),
        "code_revision": run.extras["code_revision"], "source_student": str(run.inputs.student_path),
    }
    base = run.student.get_base_model() if hasattr(run.student, "get_base_model") else run.student
    publisher.submit(step=step, state_dict=export_state_dict(run.student), model_config=base.config,
                     tokenizer=run.tokenizer, generation_config=base.generation_config, meta=meta)


def _peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


def _should_stop(cfg: Config, step: int, elapsed: float, last_step_s: float) -> str | None:
    b = cfg.budget
    if b.max_steps and step >= b.max_steps:
        return "step_horizon"
    if b.max_wall_time_s and elapsed + last_step_s + b.deadline_reserve_s >= b.max_wall_time_s:
        return "wall_clock"
    return None


def train(cfg: Config, out: str | Path, log=print, progress: bool = True) -> TrainResult:
    """One OPD run into ``out``; raises on any failure (the caller maps it to an exit status)."""
    out = Path(out)
    inputs = prepare_inputs(cfg)  # every input checked before the output directory is touched
    out.mkdir(parents=True, exist_ok=True)
    with OutputLock(out):
        return _train_locked(cfg, inputs, out, log, progress)


def _train_locked(cfg: Config, inputs, out: Path, log, progress: bool) -> TrainResult:
    atomic_write_text(out / "config.yaml", dump_yaml(cfg))
    log("resolved config:\n" + dump_yaml(cfg))
    run = build_run(cfg, inputs, log)
    run.extras["code_revision"] = code_revision()
    step, elapsed0, data_pos = _resume(out, run, log)
    publisher = Publisher(out / "checkpoints", keep=cfg.publish.keep, retries=cfg.publish.retries,
                          backoff_s=cfg.publish.backoff_s, log=log)
    engine = make_engine(cfg, run.student, run.tokenizer)
    (out / "metrics").mkdir(exist_ok=True)
    metrics_f = (out / METRICS_FILE).open("a")
    R, P, G = cfg.rollout, cfg.rollout.prompts_per_step, cfg.rollout.samples_per_prompt
    pad_id = run.tokenizer.pad_token_id
    horizon = cfg.budget.schedule_steps or cfg.budget.max_steps
    t_start, last_step_s = time.monotonic(), 0.0
    if step and not any(c.name == f"checkpoint-{step}" for c in list_checkpoints(out / "checkpoints")):
        _publish(publisher, run, step, elapsed0)  # the state's weights were never published: do it now
    bar = tqdm(total=cfg.budget.max_steps or None, initial=step, desc="train", unit="step", disable=not progress)
    reason = None
    with publisher, metrics_f, bar:
        while True:
            publisher.check()  # a failed background export stops the run here, never silently
            elapsed = elapsed0 + time.monotonic() - t_start
            reason = _should_stop(cfg, step, elapsed, last_step_s)
            if reason:
                break
            t0 = time.monotonic()
            lr = lr_at(cfg.optim.schedule, step=step, total_steps=horizon, elapsed_s=elapsed,
                       budget_s=cfg.budget.max_wall_time_s, lr=cfg.optim.lr, min_lr=cfg.optim.min_lr,
                       warmup_steps=cfg.optim.warmup_steps)
            for g in run.optimizer.param_groups:
                g["lr"] = lr

            # 1. rollout: P prompts x G samples from the student (or the teacher / references for sft)
            examples = [inputs.examples[i] for i in prompt_indices(cfg.seed, len(inputs.examples), data_pos, P)]
            data_pos += P
            prompts = run.prompts(examples)
            if cfg.loss.name == "sft" and cfg.loss.sft_source == "reference":
                sols = [run.tokenizer(ex.solution, add_special_tokens=False).input_ids for ex in examples]
                rollout = opd.reference_rollout(prompts, sols, pad_id, run.tokenizer.eos_token_id, run.device)
            else:
                sampler = make_engine(cfg, run.teacher, run.tokenizer) if cfg.loss.name == "sft" else engine
                with run.autocast():
                    rollout = sampler.sample(prompts, samples_per_prompt=G, seeds=opd.step_seeds(cfg.seed, step, P * G),
                                             temperature=R.temperature, top_p=R.top_p, max_new_tokens=R.max_new_tokens)
            if cfg.teacher.source == "model":
                t_ids, t_mask = rollout.prompt_ids_B_Sp, rollout.prompt_mask_B_Sp
            else:  # privileged: the teacher's prompt also holds the reference solution
                from opdkit.rollout import left_pad

                priv = [p for p in run.prompts(examples, privileged=True) for _ in range(G)]
                t_ids, t_mask = left_pad(priv, pad_id, run.device)
            batch = opd.Batch(rollout, t_ids, t_mask)
            t1 = time.monotonic()
            align = opd.alignment_report(batch, run.student, cfg.runtime.logprob_chunk) if (
                cfg.runtime.alignment_check and step == 0 and cfg.loss.name != "sft") else None
            if align:
                log(f"alignment check passed on the first batch: {align}")

            # 2. teacher scoring, 3. loss + backward (micro-batched, token mean over the step), 4. update
            contexts = opd.score_batch(cfg, run.teacher, batch, run.autocast, run.teacher_ctx)
            t2 = time.monotonic()
            m = opd.micro_losses(cfg, run.student, batch, contexts, run.autocast)
            grad_norm = torch.nn.utils.clip_grad_norm_([p for p in run.student.parameters() if p.requires_grad],
                                                       cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf"))
            run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)
            if run.ema is not None:
                update_ema(run.ema, run.student, cfg.teacher.ema_decay)
            step += 1
            t3 = time.monotonic()
            last_step_s = t3 - t0
            elapsed = elapsed0 + t3 - t_start

            n_tok = rollout.n_tokens
            row = {
                "step": step, "elapsed_s": round(elapsed, 3), "lr": lr, "loss": m["loss"], "kl": m.get("kl"),
                "grad_norm": float(grad_norm), "response_len": n_tok / rollout.completion_ids_B_T.shape[0],
                "truncated_frac": float(rollout.truncated_B.float().mean()), "tokens": n_tok,
                "tokens_per_s": n_tok / max(1e-9, last_step_s),
                "time_rollout_s": t1 - t0, "time_score_s": t2 - t1, "time_update_s": t3 - t2,
                "peak_mem_gb": _peak_memory_gb(run.device),
            }
            row.update({k: v for k, v in m.items() if k not in row and k not in ("tokens", "loss")})
            if align:
                row["alignment"] = align
            metrics_f.write(json.dumps(row) + "\n")
            metrics_f.flush()
            bar.update(1)
            bar.set_postfix(loss=f"{m['loss']:.4f}", kl=f"{m.get('kl') or 0:.4f}", s=f"{last_step_s:.2f}")
            if cfg.publish.every_steps and step % cfg.publish.every_steps == 0:
                _publish(publisher, run, step, elapsed)
                _save_state(out, run, step, elapsed, data_pos)
        # the intended end: publish the final weights and wait until they are complete
        if not any(c.name == f"checkpoint-{step}" for c in list_checkpoints(out / "checkpoints")) and step not in publisher.published:
            _publish(publisher, run, step, elapsed)
        publisher.close()
        _save_state(out, run, step, elapsed, data_pos)
    kept = [c.name for c in list_checkpoints(out / "checkpoints")]
    result = TrainResult("completed", reason, step, round(elapsed, 3), kept)
    atomic_write_json(out / "run.json", result.__dict__)
    log(f"training ended ({reason}) at step {step} after {elapsed:.1f}s; {surviving_checkpoints_message(out / 'checkpoints')}")
    return result
