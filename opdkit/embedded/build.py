"""Build the embedded default from scratch: task parquet, tokenizer, teacher and student.

The teacher learns the task by supervised next-token training on reference solutions. The
student is either the teacher's shape, started from the teacher's run part-way (``student_init:
teacher_run`` at ``student_base_steps``: it knows the format and most of the arithmetic), or a smaller
Llama (``student_hidden_size`` ..., a capacity gap) trained from scratch on reference solutions for
``student_base_steps`` (``student_init: scratch``). Either is then fine-tuned for
``student_carry_steps`` on solutions whose additions drop every carry: a systematic error the teacher
can correct on the student's own samples, as in real OPD (0 steps: no planted error). Step counts are
fixed, so the same seed gives the same files whatever else the machine is doing.

Bit-identical, though, only under the same floating-point kernels: the data files depend on Python's
``random`` alone and rebuild identically anywhere, while the weights depend on the torch build and the
CPU kernels it dispatches to (``torch.backends.cpu.get_cpu_capability()``: e.g. AVX2 vs AVX512), which
change the float reduction order. ``environment()`` records both in the manifest (``made.environment``),
so a rebuild can be compared with the build it should reproduce.

``build_at`` holds the kernels to one instruction set: it runs ``build`` in a fresh interpreter whose
environment (set before torch is imported there) caps each library's dispatch at that set
(``PINNED``): ATen's vectorised kernels (``ATEN_CPU_CAPABILITY``), oneDNN (``ONEDNN_MAX_CPU_ISA``),
MKL's BLAS (``MKL_ENABLE_INSTRUCTIONS``) and OpenBLAS's, where torch uses it (``OPENBLAS_CORETYPE``).
``opdkit embedded --rebuild`` pins the set the shipped manifest records, so a machine with a wider
one (AVX512) runs the shipped build's (AVX2) kernels; the manifest records what was pinned. What that
reproduces across machines and what it cannot (a library whose kernels also depend on the CPU's
vendor or cache sizes) is measured in docs/fidelity.md.
"""

from __future__ import annotations

import json
import math
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from opdkit.config import EmbeddedConfig
from opdkit.embedded import task
from opdkit.embedded.tokenizer import build_tokenizer


def student_shape(e: EmbeddedConfig) -> dict:
    """The student's (hidden_size, layers, heads, intermediate_size): each 0 in the config is the teacher's."""
    return {"hidden_size": e.student_hidden_size or e.hidden_size, "layers": e.student_layers or e.layers,
            "heads": e.student_heads or e.heads,
            "intermediate_size": e.student_intermediate_size or e.intermediate_size}


def teacher_shape(e: EmbeddedConfig) -> dict:
    return {"hidden_size": e.hidden_size, "layers": e.layers, "heads": e.heads,
            "intermediate_size": e.intermediate_size}


def check(e: EmbeddedConfig) -> None:
    """Refuse a build config that cannot be made (before anything is written)."""
    from opdkit.config import ConfigError

    s = student_shape(e)
    if e.student_init == "teacher_run" and s != teacher_shape(e):
        raise ConfigError(f"embedded.student_init=teacher_run needs the teacher's shape, got student {s} vs teacher "
                          f"{teacher_shape(e)}; set embedded.student_init=scratch for a smaller student")
    if e.student_init == "teacher_run" and not 0 <= e.student_base_steps <= e.teacher_steps:
        raise ConfigError(f"embedded.student_base_steps={e.student_base_steps} must be in 0..teacher_steps "
                          f"({e.teacher_steps}) with student_init=teacher_run")
    for name, shape in (("teacher", teacher_shape(e)), ("student", s)):
        if shape["hidden_size"] % shape["heads"]:
            raise ConfigError(f"embedded: the {name}'s hidden_size {shape['hidden_size']} is not a multiple of its "
                              f"heads {shape['heads']}")


def _arch_kwargs(shape: dict, vocab_size: int, tok) -> dict:
    return dict(
        vocab_size=vocab_size, hidden_size=shape["hidden_size"], intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"], num_key_value_heads=shape["heads"],
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
    for i, (s, y) in enumerate(zip(seqs, labels)):
        ids[i, : len(s)] = torch.tensor(s)
        lab[i, : len(y)] = torch.tensor(y)
        mask[i, : len(s)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": lab}


def _lr(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return 0.5 * peak * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def sft_train(model, tok, rows: list[dict], solutions: list[str], *, steps: int, total: int, start: int,
              batch_size: int, lr: float, warmup: int, seed: int, log=print, snapshot_at: int | None = None):
    """Supervised steps ``start..steps-1`` of a ``total``-step cosine run (on the model's device); optional
    snapshot."""
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
        batch = {k: v.to(model.device) for k, v in batch.items()}
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
    model = model.cpu()
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        do_sample=True, temperature=0.7, top_p=0.9, max_new_tokens=64,
    )
    model.save_pretrained(out)
    tok.save_pretrained(out)


# torch's CPU capability name -> the settings that cap every CPU kernel library at that instruction set
PINNED: dict[str, dict[str, str]] = {
    "AVX2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
             "OPENBLAS_CORETYPE": "Haswell"},
    "AVX512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
               "MKL_ENABLE_INSTRUCTIONS": "AVX512", "OPENBLAS_CORETYPE": "SkylakeX"},
    "DEFAULT": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
                "OPENBLAS_CORETYPE": "Nehalem"},
}
PINNED_KEYS = tuple(PINNED["AVX2"])


def environment(threads: int) -> dict:
    """What the weights' bits depend on besides the config: the torch build, the CPU kernels it uses,
    the thread count, and the transformers and Python versions; ``pinned``: the kernel libraries'
    instruction-set caps this process started with (``PINNED``; empty: each dispatched at will)."""
    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": threads, "transformers": transformers.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "pinned": {k: os.environ[k] for k in PINNED_KEYS if k in os.environ}}


def shipped_capability() -> str:
    """The CPU capability the shipped embedded default was built with (its manifest's; AVX2 before the
    manifest recorded it)."""
    from opdkit.embedded import ASSETS

    made = json.loads((ASSETS / "manifest.json").read_text()).get("made", {})
    return made.get("environment", {}).get("cpu_capability", "AVX2")


def build_at(out: Path, e: EmbeddedConfig, capability: str, log=print) -> dict:
    """``build`` in a fresh interpreter with every CPU kernel library capped at ``capability`` (a key of
    ``PINNED``, e.g. the shipped manifest's ``shipped_capability()``), set before torch is imported
    there; its log lines come through ``log``. Returns ``build``'s description."""
    if capability not in PINNED:
        from opdkit.config import ConfigError

        raise ConfigError(f"CPU capability {capability!r}: expected one of {', '.join(PINNED)} (a manifest's "
                          "made.environment.cpu_capability)")
    check(e)
    root = str(Path(__file__).resolve().parents[2])  # this opdkit, whatever the child's working directory
    env = os.environ | PINNED[capability] | {"PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    from dataclasses import asdict

    cmd = [sys.executable, "-m", "opdkit.embedded.build", str(out), json.dumps(asdict(e))]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True)
    made = None
    for line in proc.stdout:
        if line.startswith(_MADE):
            made = json.loads(line[len(_MADE):])
        else:
            log(line.rstrip("\n"))
    if proc.wait() != 0 or made is None:
        pins = " ".join(f"{k}={v}" for k, v in PINNED[capability].items())
        raise RuntimeError(f"the pinned rebuild ({capability}: {pins}) "
                           f"exited {proc.returncode}; its error is above")
    return made


_MADE = "opdkit-embedded-build-made "


def build(out: Path, e: EmbeddedConfig, log=print, device: str = "cpu") -> dict:
    """Write ``out/{data,teacher,student}``; returns a description of how they were made.

    ``device``: where the models train. The shipped assets are built on the CPU (``opdkit embedded
    --rebuild``); a CUDA build (bench/embedded_grid.py's variants) is deterministic on its GPU but differs
    in its bits from a CPU build."""
    check(e)
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
    solutions = [r["solution"] for r in train_rows]
    from_run = e.student_init == "teacher_run"

    log(f"teacher: Llama, {e.teacher_steps} steps on reference solutions")
    torch.manual_seed(e.seed)
    teacher = LlamaForCausalLM(LlamaConfig(**_arch_kwargs(teacher_shape(e), len(tok), tok))).to(device)
    base = sft_train(teacher, tok, train_rows, solutions, steps=e.teacher_steps,
                     total=e.teacher_steps, start=0, batch_size=e.batch_size, lr=e.lr, warmup=e.warmup_steps,
                     seed=e.seed, log=log, snapshot_at=e.student_base_steps if from_run else None)
    save_model(teacher, tok, out / "teacher")

    shape = student_shape(e)
    if from_run:
        log(f"student: from the teacher run at step {e.student_base_steps}")
        student = LlamaForCausalLM(LlamaConfig(**_arch_kwargs(shape, len(tok), tok))).to(device)
        student.load_state_dict(base)
        how = f"of the same shape, initialised from the teacher's run at step {e.student_base_steps}"
    else:
        log(f"student: {shape}, {e.student_base_steps} steps from scratch on reference solutions")
        torch.manual_seed(e.seed + 2)
        student = LlamaForCausalLM(LlamaConfig(**_arch_kwargs(shape, len(tok), tok))).to(device)
        sft_train(student, tok, train_rows, solutions, steps=e.student_base_steps, total=e.student_base_steps,
                  start=0, batch_size=e.batch_size, lr=e.lr, warmup=e.warmup_steps, seed=e.seed + 2, log=log)
        how = (f"(hidden {shape['hidden_size']}, {shape['layers']} layers, {shape['heads']} heads, intermediate "
               f"{shape['intermediate_size']}), trained from scratch for {e.student_base_steps} supervised steps "
               f"on reference solutions (cosine lr {e.lr} -> 0)")
    if e.student_carry_steps:
        log(f"student: {e.student_carry_steps} steps on carry-dropped solutions")
        carry = [task.carry_dropped_solution(task.parse_prompt(r["prompt"])) for r in train_rows]
        sft_train(student, tok, train_rows, carry, steps=e.student_carry_steps, total=e.student_carry_steps,
                  start=0, batch_size=e.batch_size, lr=e.student_lr, warmup=10, seed=e.seed + 1, log=log)
        how += (f", then {e.student_carry_steps} supervised steps (lr {e.student_lr}) on solutions whose additions "
                "drop every carry (47+5=42): a planted systematic error")
    save_model(student, tok, out / "student")
    n_params = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    return {
        "build_seconds": round(time.time() - t0, 1),
        "environment": environment(e.threads) | ({"device": torch.cuda.get_device_name()} if device != "cpu" else {}),
        "teacher": f"LlamaForCausalLM, {n_params(teacher)} parameters, "
                   f"{e.teacher_steps} supervised steps on reference solutions (cosine lr {e.lr} -> 0)",
        "student": f"LlamaForCausalLM, {n_params(student)} parameters, {how}",
    }


def _main(argv: list[str]) -> int:
    """``python -m opdkit.embedded.build OUT CONFIG_JSON``: ``build_at``'s child (its environment set)."""
    from opdkit.config import config_from_dict

    out, config = argv
    e = config_from_dict({"embedded": json.loads(config)}).embedded
    made = build(Path(out), e, log=lambda line: print(line, flush=True))
    print(_MADE + json.dumps(made), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
