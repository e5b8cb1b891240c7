"""``make_engine``: the engine ``rollout.engine`` names (``auto``: on CUDA the HF engine's static
decoder where Triton is installed (its kernels: ``engines.decode_kernels``), else vLLM where it is
installed, in a single process; the HF engine otherwise). vLLM under a torchrun of several
processes (``distributed_executor_backend="external_launcher"``, each rank its own prompts) is not
supported: ``rollout.engine=vllm`` there is refused before anything is written."""

from __future__ import annotations

import os

import torch

from opdkit import loss_table
from opdkit.config import ConfigError
from opdkit.engines import decode_kernels, vllm as vllm_engine
from opdkit.engines.hf import HFEngine
from opdkit.engines.sharded import wrap_engine


def torchrun_processes() -> int:
    """The number of processes of the torchrun this process belongs to (``WORLD_SIZE``; a params
    check for N processes sets it too); 1 outside torchrun."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def engine_name(cfg, device: torch.device) -> str:
    """``hf`` or ``vllm``: ``rollout.engine``, with ``auto`` resolved for ``device``."""
    if cfg.rollout.engine != "auto":
        return cfg.rollout.engine
    if device.type != "cuda" or decode_kernels.available():
        return "hf"
    return "vllm" if torchrun_processes() == 1 and vllm_engine.available() else "hf"


def check_params(cfg, device: torch.device) -> None:
    """What the engine choice and the sampling settings require of the params (raised before
    anything is written)."""
    if not 0.0 < cfg.rollout.top_p <= 1.0:
        raise ConfigError(f"rollout.top_p={cfg.rollout.top_p!r}: expected 0 < top_p <= 1 (1 = no truncation)")
    if engine_name(cfg, device) != "vllm":
        return
    if torchrun_processes() > 1:
        raise ConfigError(f"rollout.engine=vllm is not supported under torchrun with {torchrun_processes()} processes "
                          "(vLLM's external_launcher is not wired in): use rollout.engine=hf (or auto) there")
    if loss_table.samples_from(cfg.loss) == "teacher":
        raise ConfigError("loss.name=sft with loss.sft_source=teacher samples from the teacher, which would need a "
                          "second colocated vLLM engine: set rollout.engine=hf for this control")


def decoder_options(rollout) -> dict:
    """The static decoder's keyword options (``StaticDecoder``) from the ``rollout`` params."""
    return dict(gemv=rollout.decode_gemv, pdl=rollout.decode_pdl)


def make_engine(cfg, model, tokenizer):
    """The engine for ``model`` (wrapped for a sharded model; see ``engines.sharded``)."""
    device = next(model.parameters()).device
    if engine_name(cfg, device) == "hf":
        # one-step-off rollouts (own_copy) draw while the live model trains
        engine = HFEngine(model, tokenizer, static_cache=cfg.rollout.static_cache, batch_size=cfg.rollout.batch_size,
                          own_copy=cfg.rollout.overlap > 0, decoder=decoder_options(cfg.rollout))
    else:
        engine = vllm_engine.VLLMEngine(cfg, model, tokenizer)
    return wrap_engine(engine, model)
