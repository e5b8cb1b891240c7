"""Rollouts with vLLM (``rollout.engine: vllm``; ``pip install -e ".[vllm]"``, CUDA only).

``VLLMEngine`` has the interface of ``opdkit.rollout.HFEngine`` (``sample`` -> ``Rollout``,
``sync_weights``), so the training loop does not know which engine samples. It is colocated with
training on the same GPU (one engine per rank under torchrun, ``external_launcher``):

- ``gpu_memory_utilization`` (``rollout.gpu_memory_utilization``) bounds vLLM's weights + KV cache;
- sleep mode between rollouts: after ``sample`` the engine sleeps (level 1: weights to CPU, KV
  cache freed) so the optimizer step has the memory; it wakes for the next weight push or sample;
- ``sync_weights(model)`` pushes the live student into the engine after each optimizer step (LoRA
  deltas merged in, names as the base model's) and resets the prefix cache.

Sampling: one request per prompt with ``SamplingParams(n=G, temperature, top_p, max_tokens,
seed, logprobs=0)``; the seed is the per-sample seed of the prompt's first sample (vLLM seeds a
request, not each of its n samples), so vLLM rollouts are reproducible but differ from the HF
engine's. The engine runs with ``logprobs_mode="raw_logprobs"``: the returned log-prob of each
sampled token is under the raw model (temperature 1, no top-p), the scale ``Rollout`` promises.
vLLM samples in bf16, so these differ from the recomputed fp32 log-probs by bf16 rounding.

The conversion of vLLM's outputs to a ``Rollout`` (``to_rollout``) and the request parameters
(``request_params``) are plain functions, tested without vLLM.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

from opdkit.rollout import Rollout, completion_mask, left_pad


def _plain(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def request_params(n_prompts: int, *, samples_per_prompt: int, seeds: list[int], temperature: float, top_p: float,
                   max_new_tokens: int, eos_ids: list[int]) -> list[dict]:
    """``SamplingParams`` keyword arguments, one per prompt (seed: the prompt's first sample's)."""
    G = samples_per_prompt
    if len(seeds) != n_prompts * G:
        raise ValueError(f"need one seed per sample: {n_prompts * G} samples, {len(seeds)} seeds")
    return [dict(n=G, temperature=max(0.0, temperature), top_p=top_p, max_tokens=max_new_tokens, seed=seeds[p * G],
                 logprobs=0, stop_token_ids=list(eos_ids), detokenize=False)
            for p in range(n_prompts)]


def to_rollout(outputs, prompts: list[list[int]], samples_per_prompt: int, pad_id: int, eos_ids: list[int],
               device: torch.device | str = "cpu") -> Rollout:
    """vLLM ``RequestOutput``s (one per prompt, in prompt order, each with ``samples_per_prompt``
    ``CompletionOutput``s) -> a ``Rollout`` laid out as the HF engine's: rows prompt-major, prompts
    left-padded, completions right-padded with ``pad_id``, mask through the first EOS, raw-model
    log-probs of the sampled tokens (0 on padding), truncated = no EOS within the token cap.

    A ``CompletionOutput`` holds ``token_ids`` (the EOS included when it stopped there) and
    ``logprobs``: per position a mapping token id -> ``Logprob(logprob=...)`` holding at least
    the sampled token (``logprobs=0``)."""
    G = samples_per_prompt
    if len(outputs) != len(prompts):
        raise ValueError(f"vLLM returned {len(outputs)} outputs for {len(prompts)} prompts")
    rows, comps, logps = [], [], []
    for p, (req, prompt) in enumerate(zip(outputs, prompts)):
        if list(req.prompt_token_ids) != list(prompt):
            raise ValueError(f"vLLM output {p} answers another prompt than prompt {p} (outputs out of order?)")
        samples = sorted(req.outputs, key=lambda c: c.index)
        if len(samples) != G:
            raise ValueError(f"prompt {p}: vLLM returned {len(samples)} samples, expected {G}")
        for c in samples:
            ids = list(c.token_ids)
            if c.logprobs is None or len(c.logprobs) != len(ids):
                raise ValueError(f"prompt {p}, sample {c.index}: no log-prob per sampled token (logprobs=0 not set?)")
            rows.append(prompt)
            comps.append(ids)
            logps.append([float(c.logprobs[t][tok].logprob) for t, tok in enumerate(ids)])
    ids_B_Sp, mask_B_Sp = left_pad(rows, pad_id, device)
    T = max((len(c) for c in comps), default=0)
    comp_B_T = torch.full((len(comps), T), pad_id, dtype=torch.long)
    logp_B_T = torch.zeros((len(comps), T), dtype=torch.float)
    for i, (c, lp) in enumerate(zip(comps, logps)):
        comp_B_T[i, : len(c)] = torch.tensor(c, dtype=torch.long)
        logp_B_T[i, : len(lp)] = torch.tensor(lp, dtype=torch.float)
    mask_B_T, truncated_B = completion_mask(comp_B_T, eos_ids)
    comp_B_T = torch.where(mask_B_T.bool(), comp_B_T, torch.full_like(comp_B_T, pad_id))  # nothing after the EOS
    return Rollout(ids_B_Sp, mask_B_Sp, comp_B_T.to(device), mask_B_T.to(device), (logp_B_T * mask_B_T).to(device),
                   truncated_B.to(device), torch.arange(len(prompts)).repeat_interleave(G).to(device))


@torch.no_grad()
def merged_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the live model's weights as the base architecture names them, active
    LoRA deltas merged in (what a checkpoint export holds). Reads ``named_parameters``: for an
    FSDP2-sharded model call it under ``opdkit.distributed.full_params``."""
    base = _plain(model)
    lora = {name: m for name, m in base.named_modules() if hasattr(m, "base_layer") and hasattr(m, "get_delta_weight")}
    for name, p in base.named_parameters():
        if "lora_" in name:
            continue
        key = name.replace(".base_layer.", ".")
        m = lora.get(key.rsplit(".", 1)[0])
        if m is not None and key.endswith(".weight") and not getattr(m, "merged", False) and not getattr(m, "disable_adapters", False):
            w = p.float()
            for a in m.active_adapters:
                if a in m.lora_A:
                    w = w + m.get_delta_weight(a).float()
            yield key, w.to(p.dtype)
        else:
            yield key, p.detach()


def _require_vllm():
    try:
        import vllm
    except ImportError:
        raise ImportError('rollout.engine=vllm needs vLLM: pip install -e ".[vllm]" (CUDA machines only); '
                          "or use rollout.engine=hf") from None
    if not torch.cuda.is_available():
        raise RuntimeError("rollout.engine=vllm needs a CUDA GPU; use rollout.engine=hf on this machine")
    return vllm


class VLLMEngine:
    """A colocated vLLM engine sampling the live student (see the module docstring)."""

    def __init__(self, cfg, model, tokenizer):
        vllm = _require_vllm()
        from opdkit import distributed

        world = distributed.current()
        base = _plain(model)
        path = base.config._name_or_path  # the HF directory the student was loaded from
        if not path or not os.path.isdir(path):
            raise ValueError(f"rollout.engine=vllm loads the student's architecture from its HF directory; got {path!r}")
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        eos = base.generation_config.eos_token_id if base.generation_config.eos_token_id is not None else tokenizer.eos_token_id
        self.eos_ids = list(eos) if isinstance(eos, (list, tuple)) else [eos]
        if world.active:  # one engine per rank, inside the torchrun process (no engine process of its own)
            kw = dict(distributed_executor_backend="external_launcher")
        else:  # keep the engine core in this process, so weights can be pushed into its model
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            kw = {}
        self.llm = vllm.LLM(model=path, tokenizer=path, dtype="bfloat16", seed=cfg.seed, tensor_parallel_size=1,
                            gpu_memory_utilization=cfg.rollout.gpu_memory_utilization, enable_sleep_mode=True,
                            enable_prefix_caching=True, logprobs_mode="raw_logprobs", **kw)
        self.SamplingParams = vllm.SamplingParams
        self.asleep = False
        self._sleep()  # the weights loaded from `path` are the initial student; the trainer pushes the live ones

    def _wake(self) -> None:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False

    def _sleep(self) -> None:
        if not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def _model(self):
        """The model inside the (in-process) engine, for ``load_weights``."""
        try:
            return self.llm.llm_engine.model_executor.driver_worker.model_runner.model
        except AttributeError:
            raise RuntimeError("cannot reach the vLLM model to push weights into (this vLLM runs it in another process); "
                               "opdkit needs vllm>=0.10.2 with the engine in-process") from None

    def sync_weights(self, model) -> None:
        """Push the live weights (LoRA merged) into the engine; the next ``sample`` uses them."""
        self._wake()
        self._model().load_weights(weights=merged_weights(model))
        self.llm.reset_prefix_cache()  # cached prompt KV was computed with the old weights

    @torch.no_grad()
    def sample(self, prompts, *, samples_per_prompt, seeds, temperature, top_p, max_new_tokens) -> Rollout:
        params = [self.SamplingParams(**kw) for kw in request_params(
            len(prompts), samples_per_prompt=samples_per_prompt, seeds=seeds, temperature=temperature, top_p=top_p,
            max_new_tokens=max_new_tokens, eos_ids=self.eos_ids)]
        self._wake()
        try:
            outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sampling_params=params,
                                        use_tqdm=False)
        finally:
            self._sleep()  # free the GPU for scoring and the update
        return to_rollout(outputs, prompts, samples_per_prompt, self.pad_id, self.eos_ids,
                          torch.device("cuda", torch.cuda.current_device()))
