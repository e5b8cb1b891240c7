"""Build the embedded default from scratch: task parquet, tokenizer, teacher and student.

The teacher learns the task by supervised next-token training on reference solutions. The
student (same Llama shape) starts from the teacher's run part-way
(``student_base_steps``: it knows the format and most of the arithmetic) and is then fine-tuned
on solutions whose additions drop every carry: a systematic error the teacher can correct on the
student's own samples, as in real OPD. Step counts are fixed, so the same seed gives the same
files whatever else the machine is doing.

Bit-identical, though, only under the same floating-point kernels: the data files depend on Python's
``random`` alone and rebuild identically anywhere, while the weights depend on the torch build and the
CPU kernels it dispatches to (``torch.backends.cpu.get_cpu_capability()``: e.g. AVX2 vs AVX512), which
change the float reduction order. ``environment()`` records both in the manifest (``made.environment``),
so a rebuild can be compared with the build it should reproduce.
"""

from __future__ import annotations

import math
import platform
import random
import time
from pathlib import Path

import torch
import transformers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from opdkit.config import EmbeddedConfig
from opdkit.embedded import task
from opdkit.embedded.tokenizer import build_tokenizer


def _arch_kwargs(e: EmbeddedConfig, vocab_size: int, tok) -> dict:
    return dict(
        vocab_size=vocab_size, hidden_size=e.hidden_size, intermediate_size=e.intermediate_size,
        num_hidden_layers=e.layers, num_attention_heads=e.heads, num_key_value_heads=e.heads,
        max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
    )


def sft_batch(tok, prompts: list[str], solutions: list[str]) -> dict[str, torch.Tensor]:
    """Right-padded prompt+solution+eos with labels on the solution only (-100 elsewhere)."""
    seqs, labels = [], []
    for p, s in zip(prompts, solutions):
        p_ids = tok(p).input_ids
        s_ids = tok(s, add_special_tokens=False).input_ids + [tok.eos_token_id]
        seqs.append(p_ids + s_ids)
        labels.append([-100] * len(p_ids) + s_ids)
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tok.pad_token_id)
    lab = torch.full((len(seqs), width), -100)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, l) in enumerate(zip(seqs, labels)):
        ids[i, : len(s)] = torch.tensor(s)
        lab[i, : len(l)] = torch.tensor(l)
        mask[i, : len(s)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": lab}


def _lr(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return 0.5 * peak * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def sft_train(model, tok, rows: list[dict], solutions: list[str], *, steps: int, total: int, start: int,
              batch_size: int, lr: float, warmup: int, seed: int, log=print, snapshot_at: int | None = None):
    """Supervised steps ``start..steps-1`` of a ``total``-step cosine run; optional CPU snapshot."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = random.Random(seed)
    order = list(range(len(rows)))
    snapshot, t0 = None, time.time()
    model.train()
    for step in range(start, steps):
        if snapshot_at is not None and step == snapshot_at:
            snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}
        idx = rng.sample(order, batch_size)
        batch = sft_batch(tok, [rows[i]["prompt"] for i in idx], [solutions[i] for i in idx])
        for g in opt.param_groups:
            g["lr"] = _lr(step - start, total, lr, warmup)
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == steps - 1:
            log(f"  step {step:5d}/{steps}  loss {loss.item():.4f}  {time.time() - t0:6.1f}s")
    if snapshot_at is not None and snapshot is None:
        snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return snapshot


def save_model(model, tok, out: Path) -> None:
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        do_sample=True, temperature=0.7, top_p=0.9, max_new_tokens=64,
    )
    model.save_pretrained(out)
    tok.save_pretrained(out)


def environment(threads: int) -> dict:
    """What the weights' bits depend on besides the config: the torch build, the CPU kernels it uses,
    the thread count, and the transformers and Python versions."""
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": threads, "transformers": transformers.__version__, "python": platform.python_version(),
            "machine": platform.machine()}


def build(out: Path, e: EmbeddedConfig, log=print) -> dict:
    """Write ``out/{data,teacher,student}``; returns a description of how they were made."""
    torch.manual_seed(e.seed)
    torch.set_num_threads(e.threads)  # a fixed thread count: the same float reduction order every time
    torch.use_deterministic_algorithms(True)
    out = Path(out)
    (out / "data").mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    train_rows, eval_rows = task.make_splits(e.seed, e.n_train, e.n_eval, e.n_ops, e.n_ops)
    from opdkit.data import write_rows  # parquet through `datasets`

    write_rows(train_rows, out / "data" / "train.parquet")
    write_rows(eval_rows, out / "data" / "eval.parquet")
    tok = build_tokenizer()

    log(f"teacher: Llama, {e.teacher_steps} steps on reference solutions")
    torch.manual_seed(e.seed)
    teacher = LlamaForCausalLM(LlamaConfig(**_arch_kwargs(e, len(tok), tok)))
    base = sft_train(teacher, tok, train_rows, [r["solution"] for r in train_rows], steps=e.teacher_steps,
                     total=e.teacher_steps, start=0, batch_size=e.batch_size, lr=e.lr, warmup=e.warmup_steps,
                     seed=e.seed, log=log, snapshot_at=e.student_base_steps)
    save_model(teacher, tok, out / "teacher")

    log(f"student: from the teacher run at step {e.student_base_steps}, then {e.student_carry_steps} "
        "steps on carry-dropped solutions")
    student = LlamaForCausalLM(LlamaConfig(**_arch_kwargs(e, len(tok), tok)))
    student.load_state_dict(base)
    carry = [task.carry_dropped_solution(task.parse_prompt(r["prompt"])) for r in train_rows]
    sft_train(student, tok, train_rows, carry, steps=e.student_carry_steps, total=e.student_carry_steps,
              start=0, batch_size=e.batch_size, lr=e.student_lr, warmup=10, seed=e.seed + 1, log=log)
    save_model(student, tok, out / "student")
    return {
        "build_seconds": round(time.time() - t0, 1),
        "environment": environment(e.threads),
        "teacher": f"LlamaForCausalLM, {sum(p.numel() for p in teacher.parameters())} parameters, "
                   f"{e.teacher_steps} supervised steps on reference solutions (cosine lr {e.lr} -> 0)",
        "student": f"LlamaForCausalLM of the same shape, initialised from the teacher's run at step "
                   f"{e.student_base_steps}, then {e.student_carry_steps} supervised steps "
                   f"(lr {e.student_lr}) on solutions whose additions drop every carry (47+5=42): a planted "
                   "systematic error",
    }
