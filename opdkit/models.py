"""Loading models and tokenizers from local HF directories, with clear errors, and device policy.

Real 1.5B models and the embedded tiny ones take the same path: ``AutoModelForCausalLM`` and
``AutoTokenizer`` ``from_pretrained`` on a local directory (never a hub download).
``random_model`` builds a randomly initialised model of a reference shape (``SHAPES``) directly
on the target device and dtype, for benchmarks and GPU tests on machines with no weights.
"""

from __future__ import annotations

import functools
import json
import os
import weakref
from pathlib import Path

import torch

from opdkit.config import RuntimeConfig

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


class ModelError(ValueError):
    """A model directory that cannot be used (the message names it and what is missing)."""


def check_model_dir(path: str | Path, what: str = "model", weights: bool = True) -> Path:
    """Fail early (before any training) if ``path`` is not a usable HF model directory (``weights``:
    False for a model served elsewhere, whose config and tokenizer alone are read here)."""
    p = Path(path)
    if not p.exists():
        raise ModelError(f"{what} directory {p} does not exist")
    if not p.is_dir():
        raise ModelError(f"{what} path {p} is not a directory (expected an HF model directory)")
    if not (p / "config.json").is_file():
        raise ModelError(f"{what} directory {p} has no config.json (expected an HF model directory)")
    if weights and not any((p / f).is_file() for f in WEIGHT_FILES):
        raise ModelError(f"{what} directory {p} has no weights (expected one of {', '.join(WEIGHT_FILES)})")
    for f in ("model.safetensors", "pytorch_model.bin"):
        if (p / f).is_file() and (p / f).stat().st_size == 0:
            raise ModelError(f"{what} directory {p}: {f} is empty")
    if weights and any((p / f).is_file() for f in WEIGHT_FILES[:2]):  # pruned or truncated weights look complete
        from opdkit.persist.checkpoints import InvalidCheckpoint, check_weight_files

        try:
            check_weight_files(p)
        except (InvalidCheckpoint, OSError) as e:
            reason = e.reason if isinstance(e, InvalidCheckpoint) else f"cannot be read ({e})"
            raise ModelError(f"{what} directory {p}: its weights are damaged: {reason}; copy or export the model "
                             f"again (opdkit validate {p} checks a directory)") from None
    return p


def pick_device(rt: RuntimeConfig) -> torch.device:
    if rt.device == "cuda" or (rt.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ModelError("runtime.device=cuda but CUDA is not available; use runtime.device=auto or cpu")
        return torch.device("cuda", torch.cuda.current_device())  # a torchrun rank's own GPU (distributed.init sets it)
    return torch.device("cpu")


def compute_dtype(rt: RuntimeConfig, device: torch.device) -> torch.dtype:
    """The dtype matmuls run in: bf16 on CUDA (autocast over fp32 master weights), fp32 on CPU."""
    if rt.dtype == "float32":
        return torch.float32
    if rt.dtype == "bfloat16" or device.type == "cuda":
        return torch.bfloat16
    return torch.float32


def setup_torch(rt: RuntimeConfig) -> None:
    if rt.threads > 0:  # more threads than the CPUs we may run on only wait for each other
        torch.set_num_threads(min(rt.threads, len(os.sched_getaffinity(0))))
    if torch.cuda.is_available():
        # cuDNN's SDPA rebuilds its execution plan on the CPU for every new sequence length (~40 ms
        # per backward call, measured on an H200 at 8 x 1.3k tokens): slower than flash / memory-
        # efficient attention by a second per training step.
        torch.backends.cuda.enable_cudnn_sdp(False)


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load_model(path: str | Path, device: torch.device, dtype: torch.dtype = torch.float32, what: str = "model",
               trainable: bool = False):
    """``AutoModelForCausalLM.from_pretrained`` on a local directory, moved to ``device``.

    Trainable models are kept in fp32 (master weights; bf16 compute comes from autocast), frozen
    ones (teacher) in ``dtype``.
    """
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    p = check_model_dir(path, what)
    load_dtype = torch.float32 if trainable else dtype
    try:
        model = AutoModelForCausalLM.from_pretrained(str(p), dtype=load_dtype,
                                                     device_map=None if device.type == "cpu" else {"": device})
    except (OSError, ValueError, RuntimeError, SafetensorError) as e:
        raise ModelError(f"{what} directory {p} could not be loaded: {e}") from None
    model.to(device)
    check_finite_weights(model, p, what)
    if not trainable:
        model.eval().requires_grad_(False)
    return model


def check_finite_weights(model, path: str | Path, what: str = "model") -> None:
    """``ModelError`` naming the first tensor with a NaN or infinite value: such a model samples nothing that
    means anything (an evaluation of it scored 0 and exited 0; training stopped on its first batch with an
    alignment error that blamed padding). One max-abs reduction per tensor, as training checks its weights."""
    from opdkit.guards import parameters_finite

    params = list(model.parameters())
    if parameters_finite(params):
        return
    bad = next((n for n, t in model.named_parameters() if not bool(torch.isfinite(t).all())), "?")
    raise ModelError(f"{what} directory {path}: its weights hold NaN or infinite values (first: {bad}); copy or "
                     f"export the model again (opdkit validate {path} checks a directory)")


# Reference architectures (shapes only; random weights): the S1 student (a DeepSeek-R1-Distill-
# Qwen-1.5B-like Qwen2, untied embeddings) and the S2 student (Qwen3-1.7B, tied embeddings).
SHAPES: dict[str, dict] = {
    "qwen2-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                       num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                       max_position_embeddings=32768, tie_word_embeddings=False),
    "qwen3-1.7b": dict(model_type="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       max_position_embeddings=40960, tie_word_embeddings=True),
}


def shape_config(name: str, **overrides):
    """The HF config of reference shape ``name`` (``SHAPES``), with ``overrides`` (e.g. token ids)."""
    from transformers import AutoConfig

    if name not in SHAPES:
        raise ModelError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}")
    kw = {**SHAPES[name], **overrides}
    return AutoConfig.for_model(kw.pop("model_type"), **kw)


def random_model(config, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0):
    """A randomly initialised causal LM of ``config``, created directly on ``device`` in ``dtype``
    (a 1.8B model initialised in fp32 on a CPU takes minutes; on the GPU, a second)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if getattr(config, key, None) is not None:
            setattr(model.generation_config, key, getattr(config, key))
    return model


_TOKENIZER_IDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> (len, ids)


def tokenizer_ids(tok) -> int:
    """How many ids the tokenizer can emit: ``0 .. n-1`` (added tokens included). Remembered per tokenizer
    object while its length is unchanged: ``get_vocab()`` builds a dict of every token (0.16 s of CPU at
    Qwen2.5's 151,665 ids), and a run's pair checks ask about the same tokenizers about ten times."""
    n = len(tok)
    try:
        known = _TOKENIZER_IDS.get(tok)
    except TypeError:  # (an object that cannot be weakly referenced: not remembered)
        known = None
    if known is not None and known[0] == n:
        return known[1]
    ids = max(n, max(tok.get_vocab().values()) + 1)
    try:
        _TOKENIZER_IDS[tok] = (n, ids)
    except TypeError:
        pass
    return ids


def config_rows(path: str | Path) -> dict[str, int]:
    """Embedding rows a model directory declares (config.json's ``vocab_size``), before loading it."""
    f = Path(path) / "config.json"
    try:
        cfg = json.loads(f.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelError(f"{f} is not readable JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ModelError(f"{f}: expected a JSON object")
    cfg = cfg.get("text_config") or cfg  # a multimodal config nests the language model's
    if not isinstance(cfg.get("vocab_size"), int):
        raise ModelError(f"{f}: expected an integer 'vocab_size' (the embedding rows)")
    return {"input": cfg["vocab_size"], "output": cfg["vocab_size"]}


def model_rows(model) -> dict[str, int]:
    """Rows of a loaded model's input and output embeddings."""
    return {"input": model.get_input_embeddings().weight.shape[0],
            "output": model.get_output_embeddings().weight.shape[0]}


# the attention ops whose outputs ``enable_checkpointing`` keeps: torch's variable-length flash attention (packed rows,
# opdkit.packing) and sdpa's kernels
ATTENTION_OPS = ("torch_attn._varlen_attn", "aten._scaled_dot_product_flash_attention",
                 "aten._scaled_dot_product_efficient_attention", "aten._scaled_dot_product_cudnn_attention",
                 "aten._scaled_dot_product_flash_attention_for_cpu")


# the projections' matrix products (a linear layer's, under autocast too) whose outputs a layer that keeps its
# matmuls saves (``checkpoint_all_but_last``)
MATMUL_OPS = ("aten.mm", "aten.addmm")


def _save_outputs_of(saved: tuple[str, ...], ctx, op, *args, **kwargs):
    """Selective activation checkpointing's policy: save the outputs of the ops named in ``saved``, recompute
    the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    if str(op).rsplit(".", 1)[0] in saved:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


# save the attention ops' outputs, recompute the rest
keep_attention_policy = functools.partial(_save_outputs_of, ATTENTION_OPS)
# save the attention ops' and the projections' outputs: the backward's recompute of a layer then runs only its
# elementwise ops (norms, rotary, casts, the MLP's activation), on the values the forward saved
keep_matmuls_policy = functools.partial(_save_outputs_of, ATTENTION_OPS + MATMUL_OPS)


def selective_context(policy):
    """A checkpoint's ``context_fn`` for torch's selective activation checkpointing under ``policy``."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return functools.partial(create_selective_checkpoint_contexts, policy)


def enable_checkpointing(model, keep_attention: bool) -> None:
    """HF gradient checkpointing of ``model``'s layers (non-reentrant); with ``keep_attention`` each layer's
    attention output is saved by the forward and reused by the recompute (torch's selective activation
    checkpointing with ``keep_attention_policy``): the same values, one attention forward less per layer for
    the memory of its output (tokens x hidden in bf16, and the log-sum-exp, per layer)."""
    kwargs = {"use_reentrant": False}
    if keep_attention:
        kwargs["context_fn"] = selective_context(keep_attention_policy)
    hf_checkpointing(model, True, kwargs)


def hf_checkpointing(model, on: bool, kwargs: dict | None = None) -> None:
    """transformers' checkpointing of ``model``'s layers switched on (``kwargs``: torch's checkpoint's keywords) or
    off, by the name the installed transformers gives it: ``activation_checkpointing_enable`` / ``_disable`` where
    it has them (the ``gradient_checkpointing_*`` names are deprecated there, to go in v6), else those."""
    new = "activation_checkpointing_enable" if on else "activation_checkpointing_disable"
    if hasattr(model, new):
        getattr(model, new)(**({"activation_checkpointing_kwargs": kwargs} if on else {}))
    elif on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_disable()


def checkpoint_all_but_last(layers, n_unchecked: int, n_keep_matmuls: int = 0) -> None:
    """Under gradient checkpointing (``enable_checkpointing``): the last ``n_unchecked`` of the decoder's
    ``layers`` run without it (they keep their activations for the backward instead of recomputing them),
    the ``n_keep_matmuls`` before them with it but keeping their projections' and attention's outputs
    (``keep_matmuls_policy``: their recompute runs only the elementwise ops), the others as
    ``enable_checkpointing`` set them. The same values and gradients either way (the recompute runs the
    same kernels on the same inputs): more memory for less compute. The last layers, because the
    backward reaches them first and frees what they kept before the others' recomputes need memory."""
    L = len(layers)
    for i, layer in enumerate(layers):
        layer.gradient_checkpointing = i < L - n_unchecked
        func = getattr(layer, "_gradient_checkpointing_func", None)
        if func is None:
            continue
        base = getattr(func, "opdkit_base", func)  # as enable_checkpointing set it
        if L - n_unchecked - n_keep_matmuls <= i < L - n_unchecked:
            func = functools.partial(base, context_fn=selective_context(keep_matmuls_policy))
            func.opdkit_base = base
        else:
            func = base
        layer._gradient_checkpointing_func = func
