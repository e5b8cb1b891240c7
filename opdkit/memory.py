"""An estimate of one training process's peak memory on its device, from the models' configs.

What a step holds, as ``opdkit.setup`` / ``opdkit.opd`` hold it (one process, nothing sharded):

- all the time: the student's fp32 master weights (compute in bf16 comes from autocast), the
  AdamW moments of the trainable parameters (two fp32 tensors each), the teacher's weights in the
  compute dtype (each of several teachers'; none here with ``teacher.device`` elsewhere or a vLLM
  teacher; a privileged teacher: an fp32 copy of the student, or none), and the CUDA static
  decoder's bf16 copy of the student;
- while scoring, with a colocated vLLM teacher: its share of the GPU
  (``teacher.gpu_memory_utilization``; asleep, with its weights in CPU memory, otherwise);
- while rolling out: the KV cache of one decode call (``rollout.batch_size`` rows, else the
  step's), or vLLM's share of the GPU (``rollout.gpu_memory_utilization``);
- while updating: the fp32 gradients, the activations autograd saves for one micro-batch, and one
  chunk of logits (``runtime.logprob_chunk`` positions x the vocabulary, fp32: logits,
  log-softmax and their gradient; the teacher's full log-softmax too for full-vocabulary losses).

Activations per token and decoder layer (Llama / Qwen2 layers, SDPA attention): the two RMSNorms'
inputs and outputs, the q/k/v, o, gate/up and down projections' inputs, attention's q, k, v and
output, the MLP's gate, up and product: ``9 H + 2 kv + 4 I`` values (``kv``: key-value heads x
head size, ``I``: the MLP width) in fp32; under bf16 autocast the norms stay fp32 and each
projection saves its own bf16 cast. With gradient checkpointing a layer keeps only its input
(``H``) and one layer is recomputed at a time. Allocator overhead, fragmentation and kernel
workspaces are not counted: this is an estimate, not a measurement. Under checkpointing this is
what the update needs; on a GPU its last layers then also run unchecked in what memory is left
(``runtime.unchecked_layers_memory``, ``step.uncheck_layers``), or first keep their projections' outputs
(``runtime.checkpoint_keep_matmuls``, ``layer_plan``), so a run's peak is higher where memory allows it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from opdkit import loss_table
from opdkit.config import Config

GIB = 2**30
GRADIENTS = "gradients (fp32)"


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of a model (``model_shape``)."""

    params: int  # every parameter (LoRA adapters included when wrapped)
    trainable: int  # those the optimizer updates
    layers: int
    hidden: int
    kv: int  # key-value heads x head size
    intermediate: int
    rows: int  # output embedding rows (the logits' width)


def model_shape(path: str | Path, lora=None) -> ModelShape:
    """The shape of the model in ``path`` from its config.json: a skeleton on the meta device (no
    weights read or allocated), wrapped with ``lora`` (a ``LoraConfig`` section) where enabled."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    if lora is not None and lora.enabled:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                 target_modules=list(lora.target_modules), task_type="CAUSAL_LM"))
    return shape_of(model)


def kv_width(text_config) -> int:
    """Key-value heads x head size of a decoder's (text) config."""
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    return (getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads) * head_dim


def kv_cache_bytes(s: ModelShape, tokens: int, value_bytes: int) -> int:
    """Bytes of one sequence's KV cache over ``tokens`` positions: keys and values of every layer, ``value_bytes``
    a value."""
    return tokens * s.layers * 2 * s.kv * value_bytes


def layer_activation_bytes(hidden: int, kv: int, intermediate: int, compute_bytes: int) -> int:
    """Bytes autograd saves per token for one decoder layer run without checkpointing (see the module
    docstring): ``hidden`` H, ``kv`` (key-value heads x head size), ``intermediate`` (the MLP's width I);
    ``compute_bytes`` 4 (fp32) or 2 (bf16 autocast over fp32 weights: the norms stay fp32)."""
    H, kv, Im = hidden, kv, intermediate
    if compute_bytes == 4:
        return 4 * (9 * H + 2 * kv + 4 * Im)
    # autocast: the norms' inputs and outputs (4 H) in fp32; each projection's own cast of its input
    return 4 * 4 * H + compute_bytes * (8 * H + 2 * kv + 4 * Im)  # (5 + 1) H inputs, attention 2 H + 2 kv, MLP 4 I


def kept_matmul_bytes(hidden: int, kv: int, intermediate: int, compute_bytes: int) -> int:
    """Bytes per token that a checkpointed layer keeping its matmuls (``models.keep_matmuls_policy``) saves beyond
    its input and attention output: the projections' outputs, q/k/v (``H + 2 kv``), o, gate and up (``2 I``) and down,
    in the compute dtype (``compute_bytes``)."""
    return compute_bytes * (3 * hidden + 2 * kv + 2 * intermediate)


def layer_plan(budget_bytes: int, tokens: int, layer_bytes_per_token: int, kept_bytes_per_token: int,
               n_layers: int) -> tuple[int, int]:
    """How ``n_layers`` checkpointed decoder layers spend ``budget_bytes`` of spare memory at ``tokens`` tokens:
    (unchecked, keeping their matmuls). A layer that keeps its matmuls (``kept_bytes_per_token``,
    ``kept_matmul_bytes``) skips the recompute's matrix products, most of a layer's forward, for less memory than
    an unchecked one (``layer_bytes_per_token``) skips the rest: so as many layers as fit keep their matmuls, then
    of those as many as the rest of the budget allows run unchecked. ``kept_bytes_per_token`` 0: unchecked only
    (``layers_without_checkpointing``)."""
    if kept_bytes_per_token <= 0:
        return layers_without_checkpointing(budget_bytes, tokens, layer_bytes_per_token, n_layers), 0
    kept = layers_without_checkpointing(budget_bytes, tokens, kept_bytes_per_token, n_layers)
    left = budget_bytes - kept * max(1, tokens * kept_bytes_per_token)
    unchecked = min(kept, layers_without_checkpointing(left, tokens, layer_bytes_per_token - kept_bytes_per_token,
                                                       n_layers))
    return unchecked, kept - unchecked


def layers_without_checkpointing(budget_bytes: int, tokens: int, layer_bytes_per_token: int, n_layers: int) -> int:
    """How many of ``n_layers`` decoder layers may run without gradient checkpointing (keeping their
    activations for the backward instead of recomputing them) when their activations may take
    ``budget_bytes``: each layer holds ``tokens`` x ``layer_bytes_per_token`` (``layer_activation_bytes``).
    0 with no budget; at most ``n_layers``."""
    per_layer = max(1, tokens * layer_bytes_per_token)
    return max(0, min(n_layers, budget_bytes // per_layer))


def shape_of(model) -> ModelShape:
    """``model_shape`` of a loaded (causal LM) model, peft-wrapped or not."""
    text = model.config.get_text_config()
    params = list(model.parameters())
    return ModelShape(params=sum(p.numel() for p in params),
                      trainable=sum(p.numel() for p in params if p.requires_grad),
                      layers=text.num_hidden_layers, hidden=text.hidden_size, kv=kv_width(text),
                      intermediate=text.intermediate_size, rows=model.get_output_embeddings().weight.shape[0])


def checkpointed_update_bytes(s: ModelShape, tokens: int, chunk_rows: int, chunk: int, compute_bytes: int,
                              keep_attention: bool) -> int:
    """What an update with every layer checkpointed allocates beyond what is held (``estimate``'s update
    phase): the fp32 gradients of the trainable parameters, the activations of ``tokens`` under checkpointing
    (``activation_bytes_per_token``; ``keep_attention``: runtime.checkpoint_keep_attention) and one logits chunk
    (``chunk_rows`` x ``chunk`` positions x the vocabulary: logits, log-softmax and their gradient, fp32)."""
    return (4 * s.trainable + tokens * activation_bytes_per_token(s, compute_bytes, True, keep_attention)
            + 3 * 4 * chunk_rows * chunk * s.rows)


def free_device_bytes(device: torch.device) -> int:
    """Bytes a CUDA ``device`` can still allocate: free on the device plus what torch's caching allocator
    holds unused; 0 elsewhere (no budget for un-checkpointed layers on a CPU)."""
    if device.type != "cuda":
        return 0
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def activation_bytes_per_token(s: ModelShape, compute_bytes: int, checkpointing: bool,
                               keep_attention: bool = False) -> int:
    """Bytes autograd saves per token of a micro-batch for the whole decoder (see the module docstring);
    ``keep_attention`` (``runtime.checkpoint_keep_attention``): under checkpointing, each layer's attention output
    too (S1 at 7,168 on an H200: +4.6 GB for 57,344 tokens, this term 4.9)."""
    H = s.hidden
    layer = layer_activation_bytes(s.hidden, s.kv, s.intermediate, compute_bytes)
    if checkpointing:  # each layer's fp32 input (and attention output), one layer's full set while it is recomputed
        return s.layers * (4 * H + (compute_bytes * H if keep_attention else 0)) + layer
    return s.layers * layer


def estimate(cfg: Config, student: ModelShape, teacher: ModelShape | list[ModelShape] | None, prompt_tokens: int,
             device: torch.device, engine: str, device_total: int) -> dict[str, dict[str, int]]:
    """Bytes by phase: ``{"held": ..., "rollout": ..., "update": ..., "score": ...}``, each ``{part:
    bytes}``. The peak is ``held`` + the largest phase (``peak``). ``teacher``: its shape, or each of
    several teachers'; ``prompt_tokens``: the longest prompt of a step; ``engine``: ``hf`` or
    ``vllm`` as resolved for ``device``."""
    teachers = teacher if isinstance(teacher, list) else [teacher] if teacher is not None else []
    teacher = teachers[0] if teachers else None
    R, Opt = cfg.rollout, cfg.optim
    cuda = device.type == "cuda"
    compute = 2 if cuda and cfg.runtime.dtype != "float32" else 4
    rows_step = R.prompts_per_step * R.samples_per_prompt
    tokens = prompt_tokens + R.max_new_tokens
    held = {"student fp32 weights": 4 * student.params, "AdamW moments (fp32)": 8 * student.trainable}
    src = cfg.teacher.source
    score = {}
    if src == "model" and teachers and _here(cfg.teacher.device, device):
        for i, t in enumerate(teachers):
            name = f"teacher{f' {i + 1}' if len(teachers) > 1 else ''} weights ({'bf16' if compute == 2 else 'fp32'})"
            held[name] = compute * t.params
    elif src == "vllm" and cuda and not cfg.teacher.url:
        share = cfg.teacher.gpu_memory_utilization
        score[f"the vLLM teacher's share of the GPU (teacher.gpu_memory_utilization={share:g})"] = (
            int(share * device_total))
    elif src == "privileged_ema" or (src == "privileged_fixed" and not cfg.lora.enabled):
        held["teacher: an fp32 copy of the student"] = 4 * student.params
    rollout = {}
    if engine == "vllm":
        rollout[f"vLLM's share of the GPU (rollout.gpu_memory_utilization={R.gpu_memory_utilization:g})"] = int(
            R.gpu_memory_utilization * device_total)
    else:
        decode_rows = R.batch_size or rows_step
        kv_bytes = 2 if cuda else 4  # generate's cache on the CPU is fp32; the static decoder's is bf16
        rollout[f"KV cache ({decode_rows} rows x {tokens:,} tokens)"] = (
            decode_rows * kv_cache_bytes(student, tokens, kv_bytes))
        if cuda and R.static_cache:
            held["static decoder's bf16 copy of the student"] = 2 * student.params
    mb_rows = min(Opt.micro_batch or rows_step, rows_step)
    ckpt, keep = cfg.runtime.grad_checkpointing, cfg.runtime.checkpoint_keep_attention
    chunk = min(cfg.runtime.logprob_chunk, R.max_new_tokens)
    update = {
        GRADIENTS: 4 * student.trainable,
        f"activations ({mb_rows} rows x {tokens:,} tokens{', gradient checkpointing' if ckpt else ''})":
            mb_rows * tokens * activation_bytes_per_token(student, compute, ckpt, keep),
        f"logits chunk ({mb_rows} rows x {chunk} positions x {student.rows:,})": 3 * 4 * mb_rows * chunk * student.rows,
    }
    if loss_table.teacher_need(cfg.loss, cfg.rollout) == "full" and teacher is not None:
        update["teacher's log-softmax chunk"] = 4 * mb_rows * chunk * teacher.rows
        if not _here(cfg.teacher.device, device):
            update["the teacher's head, copied here (bf16)"] = 2 * teacher.rows * teacher.hidden
    return {"held": held, "rollout": rollout, "update": update, "score": score}


def _here(setting: str, device: torch.device) -> bool:
    """``teacher.device`` puts the teacher on ``device`` ("" = the student's, which this is)."""
    if not setting:
        return True
    t = torch.device(setting)
    return t.type == device.type and t.index in (None, device.index)


def peak(parts: dict[str, dict[str, int]]) -> int:
    """The estimated peak: what is held, plus the largest phase."""
    return sum(parts["held"].values()) + max(sum(v.values()) for k, v in parts.items() if k != "held")


def fixed(parts: dict[str, dict[str, int]]) -> int:
    """The part of the peak no batch setting changes: what is held, plus the gradients (exact
    counts, not estimates)."""
    return sum(parts["held"].values()) + parts["update"][GRADIENTS]


def device_memory(device: torch.device) -> tuple[int, int]:
    """(total, available) bytes of ``device``: the GPU's, or the machine's RAM (/proc/meminfo)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total, free
    info = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    total = info.get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total, info.get("MemAvailable", total)
