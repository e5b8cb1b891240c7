"""An embedded teacher with a tokenizer of its own, for cross-tokenizer OPD (``teacher.tokenizer=own``):
a byte-level BPE (GPT-2's pre-tokenizer, ``embedded.bpe_vocab_size`` ids) trained with ``tokenizers``
on the embedded training split, and a teacher trained on it with the embedded teacher's recipe
(``build.build``'s: the teacher's shape, ``embedded.teacher_steps`` supervised steps on reference
solutions, the same lr schedule and seed). The embedded (character-level) teacher is its control.

Built on demand (``opdkit embedded --bpe-teacher --out DIR``; about 4 MB of fp32 weights, too large
to ship) and cached: a directory whose manifest records the same build config is reused as it is.
The tokenizer has the character-level tokenizer's special tokens (``<pad> <bos> <eos> <unk>``, ids
0..3, ``<bos>`` in front of every encoding), so an answer's end is ``<eos>`` on both sides.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from opdkit.config import EmbeddedConfig, to_dict
from opdkit.embedded import file_hashes, task
from opdkit.embedded.build import _arch_kwargs, environment, save_model, sft_train, teacher_shape
from opdkit.embedded.tokenizer import SPECIALS


def build_bpe_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE of at most ``vocab_size`` ids trained on ``texts`` (deterministic for the same texts)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIALS),
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    bos = tok.token_to_id("<bos>")
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                       special_tokens=[("<bos>", bos)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>", padding_side="left", model_max_length=512,
                                   clean_up_tokenization_spaces=False)


def build_config(e: EmbeddedConfig) -> dict:
    """What the BPE teacher's bits depend on (its cache key)."""
    return {"kind": "bpe_teacher", "embedded": to_dict(e)}


def build_bpe_teacher(out: str | Path, e: EmbeddedConfig, log=print) -> dict:
    """Write the BPE teacher's HF directory to ``out`` (unless it holds this build already); returns its
    manifest (``config``, ``made``, ``files``)."""
    out = Path(out)
    config = build_config(e)
    if (out / "manifest.json").is_file():
        manifest = json.loads((out / "manifest.json").read_text())
        if manifest.get("config") == config and manifest.get("files") == file_hashes(out):
            log(f"{out} holds this BPE teacher already (manifest.json): reused")
            return manifest
    torch.manual_seed(e.seed)
    torch.set_num_threads(e.threads)
    torch.use_deterministic_algorithms(True)
    t0 = time.time()
    train_rows, _ = task.make_splits(e.seed, e.n_train, e.n_eval, e.n_ops, e.n_ops)
    solutions = [r["solution"] for r in train_rows]
    tok = build_bpe_tokenizer([r["prompt"] + s for r, s in zip(train_rows, solutions)], e.bpe_vocab_size)
    log(f"BPE teacher: {len(tok)} ids; Llama {teacher_shape(e)}, {e.teacher_steps} steps on reference solutions")
    torch.manual_seed(e.seed)
    teacher = LlamaForCausalLM(LlamaConfig(**_arch_kwargs(teacher_shape(e), len(tok), tok)))
    sft_train(teacher, tok, train_rows, solutions, steps=e.teacher_steps, total=e.teacher_steps, start=0,
              batch_size=e.batch_size, lr=e.lr, warmup=e.warmup_steps, seed=e.seed, log=log)
    out.mkdir(parents=True, exist_ok=True)
    save_model(teacher, tok, out)
    made = {"build_seconds": round(time.time() - t0, 1), "environment": environment(e.threads),
            "teacher": f"LlamaForCausalLM, {sum(p.numel() for p in teacher.parameters())} parameters, byte-level BPE "
                       f"of {len(tok)} ids, {e.teacher_steps} supervised steps on reference solutions (cosine lr "
                       f"{e.lr} -> 0)"}
    manifest = {"config": config, "made": made, "files": file_hashes(out)}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
