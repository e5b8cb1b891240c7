"""``merged_weights``: a model's weights as its base architecture names them, LoRA folded in.

The one implementation behind every place that needs plain weights of the live student: the
static decoder's weight sync, the push into vLLM, checkpoint export, and FSDP2 gathering. Yields
one tensor at a time (a sharded parameter is gathered with ``full_tensor`` when it is reached and
can be dropped before the next is gathered), so a caller that streams never holds a second full
copy of the model. Every rank of a sharded model must iterate it in full, in the same order.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


def plain(model):
    """The transformers model under a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def full(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain tensor: an FSDP2 (DTensor) shard is all-gathered (collective)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _lora_modules(base) -> dict:
    """{module name: peft LoRA layer} of the modules with adapters that are active and not merged."""
    out = {}
    for name, m in base.named_modules():
        if not (hasattr(m, "base_layer") and hasattr(m, "lora_A")):
            continue
        if getattr(m, "merged", False) or getattr(m, "disable_adapters", False):
            continue
        if any(m.use_dora.get(a, False) for a in m.active_adapters) or not isinstance(m.base_layer, torch.nn.Linear):
            raise NotImplementedError(f"merging {type(m).__name__} at {name}: only plain LoRA on Linear layers")
        out[name] = m
    return out


@torch.no_grad()
def merged_weights(model, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every parameter and persistent buffer of ``model``'s base architecture,
    named as in its own ``state_dict`` (tied weights under each name), the active LoRA adapters
    merged in: ``W + scaling * B @ A`` computed in float32, then cast to ``dtype`` (default: the
    parameter's own). Tensors stay on the model's device; the LoRA weights themselves are skipped.
    """
    base = plain(model)
    lora = _lora_modules(base)
    named = dict(base.named_parameters(remove_duplicate=False))
    for name, buf in base.named_buffers(remove_duplicate=False):
        owner, _, leaf = name.rpartition(".")
        mod = base.get_submodule(owner) if owner else base
        if leaf not in mod._non_persistent_buffers_set:
            named[name] = buf
    for name, t in named.items():
        if "lora_" in name:
            continue
        key = name.replace(".base_layer.", ".")
        m = lora.get(key.rpartition(".")[0]) if key.endswith(".weight") else None
        w = full(t.detach())
        if m is not None:
            w = w.float()
            for a in m.active_adapters:
                if a not in m.lora_A:
                    continue
                delta = full(m.lora_B[a].weight).float() @ full(m.lora_A[a].weight).float()
                w = w + (delta.T if m.fan_in_fan_out else delta) * m.scaling[a]
            w = w.to(t.dtype)
        yield key, w if dtype is None else w.to(dtype)


def export_state_dict(model, keep: bool = True, dtype: torch.dtype | None = None, copy=None) -> dict[str, torch.Tensor]:
    """A CPU copy of ``merged_weights`` (what a checkpoint holds), cast to ``dtype`` where they live
    (None: as they are). For a sharded model every rank takes part in the gathering; only a rank
    with ``keep`` copies the tensors ({} elsewhere). ``copy(name, tensor)`` makes each CPU copy
    (default: a new tensor; ``publish.Snapshot`` reuses pinned host memory)."""
    out = {}
    for k, v in merged_weights(model, dtype):
        if keep:
            out[k] = copy(k, v) if copy is not None else v.to("cpu", copy=True)
    return out
