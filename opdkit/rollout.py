"""Rollout: the student samples completions for P prompts x G samples.

Engines share one interface (``RolloutEngine.sample``) and return a ``Rollout``. Prompts are
left-padded (so every sequence's positions run contiguously from its first real token) and each
row is sampled with its own seed, derived from ``(seed, step, index)``: a sample does not depend
on what else is in the batch.

Sampling (``perturbed_logits``): temperature, top-p, then Gumbel-max with counter-based noise,
a hash of ``(row seed, token index t, vocabulary id)`` in integer arithmetic. The noise is the
same on every device and for every batch composition, so a sample depends only on its seed and
the model's logits. Each engine also records the log-probability of each sampled token under the
raw model (temperature 1, no top-p): the sampling-time log-probs that the policy-gradient ratio
compares against, on the same scale as the log-probs the loss recomputes.

Two implementations behind ``HFEngine``: on CPU (or ``static_cache=False``) ``model.generate``
with the sampler as a logits processor; on CUDA with ``static_cache=True`` the static-KV-cache,
CUDA-graph decoder of ``opdkit.decode`` on a bf16 inference copy of the live policy.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList


def sample_seed(seed: int, step: int, index: int) -> int:
    """A stable 63-bit seed for sample ``index`` of ``step`` (the same on every machine)."""
    digest = hashlib.sha256(f"{seed}/{step}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclass
class Rollout:
    """B = P*G sampled sequences (prompt-major: rows p*G .. p*G+G-1 share prompt p)."""

    prompt_ids_B_Sp: torch.Tensor  # left-padded prompt tokens
    prompt_mask_B_Sp: torch.Tensor  # 1 on real prompt tokens
    completion_ids_B_T: torch.Tensor  # sampled tokens, padded on the right with pad_id
    completion_mask_B_T: torch.Tensor  # 1 on sampled tokens up to and including the first EOS
    sampling_logp_B_T: torch.Tensor  # raw-model log p of each sampled token (0 on padding)
    truncated_B: torch.Tensor  # bool: hit the token cap without emitting EOS
    prompt_index_B: torch.Tensor  # which prompt each row answers

    @property
    def n_tokens(self) -> int:
        return int(self.completion_mask_B_T.sum())


class RolloutEngine(Protocol):
    def sample(
        self, prompts: list[list[int]], *, samples_per_prompt: int, seeds: list[int],
        temperature: float, top_p: float, max_new_tokens: int,
    ) -> Rollout: ...

    def sync_weights(self, model: torch.nn.Module) -> None: ...


def left_pad(seqs: list[list[int]], pad_id: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists -> (ids_B_S, mask_B_S)."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s):] = 1
    return ids.to(device), mask.to(device)


def completion_mask(ids_B_T: torch.Tensor, eos_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask of real completion tokens (through the first EOS) and the truncated flag.

    Works where pad == eos: the mask comes from the position of the first EOS, not from
    comparing tokens with the pad id. Returns (mask_B_T float, truncated_B bool).
    """
    is_eos_B_T = torch.zeros_like(ids_B_T, dtype=torch.bool)
    for e in eos_ids:
        is_eos_B_T |= ids_B_T == e
    # eos_before_B_T: an EOS strictly before position t (cumulative count shifted right by one)
    seen_B_T = is_eos_B_T.long().cumsum(dim=1)
    eos_before_B_T = (seen_B_T - is_eos_B_T.long()) > 0
    mask_B_T = (~eos_before_B_T).float()
    truncated_B = ~is_eos_B_T.any(dim=1)
    return mask_B_T, truncated_B


def top_p_filter(logits_B_V: torch.Tensor, top_p: float) -> torch.Tensor:
    """Set logits outside the smallest set with cumulative probability >= top_p to -inf."""
    if top_p >= 1.0:
        return logits_B_V
    sorted_B_V, order_B_V = torch.sort(logits_B_V, descending=True, dim=-1)
    cum_B_V = sorted_B_V.softmax(dim=-1).cumsum(dim=-1)
    remove_B_V = (cum_B_V - sorted_B_V.softmax(dim=-1)) >= top_p  # mass before this entry already >= top_p
    remove_B_V[:, 0] = False
    sorted_B_V = sorted_B_V.masked_fill(remove_B_V, float("-inf"))
    return torch.empty_like(logits_B_V).scatter_(-1, order_B_V, sorted_B_V)


# splitmix64 constants as signed int64 (torch integer arithmetic wraps modulo 2**64)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser: a bijection of int64 that scrambles every bit."""
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def uniform_noise(seeds_B: torch.Tensor, t, V: int) -> torch.Tensor:
    """(B, V) float32 uniforms in (0, 1) from ``(seed_b, t, v)`` by integer hashing.

    ``t`` (int or 0-dim int64 tensor) is the index of the token being sampled. Pure integer
    arithmetic: the same bits on CPU and GPU, and no generator state (so it can run inside a CUDA
    graph). 24 bits per draw, as ``torch.rand`` gives in float32.
    """
    key_B = _mix64(seeds_B * _GOLDEN + t)  # one stream per (row, token index)
    v_V = torch.arange(V, device=seeds_B.device, dtype=torch.int64)
    bits_B_V = _mix64(key_B[:, None] + v_V[None, :] * _GOLDEN)
    return (_shr(bits_B_V, 40).float() + 0.5) * (1.0 / (1 << 24))


def perturbed_logits(raw_B_V: torch.Tensor, seeds_B: torch.Tensor, t, temperature: float, top_p: float) -> torch.Tensor:
    """Tempered, top-p-filtered logits plus Gumbel noise: their argmax is a sample (greedy if T<=0)."""
    if temperature <= 0:
        return raw_B_V
    logits_B_V = top_p_filter(raw_B_V / temperature, top_p)
    gumbel_B_V = -torch.log(-torch.log(uniform_noise(seeds_B, t, raw_B_V.shape[1])))
    return logits_B_V + gumbel_B_V


class SeededSampler(LogitsProcessor):
    """Per-row seeded sampling inside greedy ``generate``; records raw log-probs of chosen tokens."""

    def __init__(self, seeds: list[int], temperature: float, top_p: float, prompt_width: int, device):
        self.seeds_B = torch.tensor(seeds, dtype=torch.int64, device=device)
        self.temperature, self.top_p, self.prompt_width = temperature, top_p, prompt_width
        self.prev_logp_B_V: torch.Tensor | None = None
        self.logps: list[torch.Tensor] = []

    def _record(self, chosen_B: torch.Tensor) -> None:
        if self.prev_logp_B_V is not None:
            self.logps.append(self.prev_logp_B_V.gather(1, chosen_B[:, None])[:, 0])

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        t = input_ids.shape[1] - self.prompt_width  # index of the token sampled now
        if t > 0:
            self._record(input_ids[:, -1])
        raw_B_V = scores.float()
        self.prev_logp_B_V = raw_B_V.log_softmax(dim=-1)
        return perturbed_logits(raw_B_V, self.seeds_B, t, self.temperature, self.top_p)

    def finish(self, completion_ids_B_T: torch.Tensor) -> torch.Tensor:
        """Log-probs of the sampled tokens, (B, T); call once after ``generate``."""
        T = completion_ids_B_T.shape[1]
        if len(self.logps) < T:
            self._record(completion_ids_B_T[:, len(self.logps)])
        return torch.stack(self.logps[:T], dim=1) if T else completion_ids_B_T.new_zeros((completion_ids_B_T.shape[0], 0), dtype=torch.float)


class HFEngine:
    """Rollouts of the live policy with ``transformers`` models.

    CPU, or ``static_cache=False``: ``model.generate`` (dynamic KV cache) on the live model. CUDA
    with ``static_cache=True``: ``opdkit.decode.StaticDecoder``, a bf16 inference copy refreshed
    from the live model (LoRA merged in) at every ``sample`` call, static KV cache, CUDA graphs.
    """

    def __init__(self, model, tokenizer, *, static_cache: bool = True, batch_size: int = 0):
        self.model, self.tokenizer = model, tokenizer
        self.static_cache = static_cache
        self.batch_size = batch_size  # rows per generate call; 0 = all at once
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        eos = model.generation_config.eos_token_id if model.generation_config.eos_token_id is not None else tokenizer.eos_token_id
        self.eos_ids = list(eos) if isinstance(eos, (list, tuple)) else [eos]
        self.decoder = None  # the StaticDecoder, made on first use

    def sync_weights(self, model) -> None:  # every sample() reads the live model's current weights
        self.model = model

    @torch.no_grad()
    def sample(self, prompts, *, samples_per_prompt, seeds, temperature, top_p, max_new_tokens) -> Rollout:
        rows = [p for p in prompts for _ in range(samples_per_prompt)]  # prompt-major: B = P*G
        if len(seeds) != len(rows):
            raise ValueError(f"need one seed per sample: {len(rows)} samples, {len(seeds)} seeds")
        device = next(self.model.parameters()).device
        if self.static_cache and device.type == "cuda":
            from opdkit.decode import StaticDecoder

            if self.decoder is None:
                self.decoder = StaticDecoder(self.model)
            else:
                self.decoder.sync(self.model)
        step = self.batch_size or len(rows)
        parts = [self._generate(rows[i:i + step], seeds[i:i + step], temperature, top_p, max_new_tokens, device)
                 for i in range(0, len(rows), step)]
        prompt_index_B = torch.arange(len(prompts)).repeat_interleave(samples_per_prompt)
        return _concat(parts, prompt_index_B, self.pad_id)

    def _generate(self, rows, seeds, temperature, top_p, max_new_tokens, device):
        ids_B_Sp, mask_B_Sp = left_pad(rows, self.pad_id, device)
        if self.decoder is not None:
            comp_B_T, logp_B_T = self.decoder.generate(ids_B_Sp, mask_B_Sp, seeds, temperature=temperature, top_p=top_p,
                                                       max_new_tokens=max_new_tokens, eos_ids=self.eos_ids)
        else:
            comp_B_T, logp_B_T = self._hf_generate(ids_B_Sp, mask_B_Sp, seeds, temperature, top_p, max_new_tokens)
        mask_B_T, truncated_B = completion_mask(comp_B_T, self.eos_ids)
        comp_B_T = torch.where(mask_B_T.bool(), comp_B_T, torch.full_like(comp_B_T, self.pad_id))
        return ids_B_Sp, mask_B_Sp, comp_B_T, mask_B_T, logp_B_T * mask_B_T, truncated_B

    def _hf_generate(self, ids_B_Sp, mask_B_Sp, seeds, temperature, top_p, max_new_tokens):
        sampler = SeededSampler(seeds, temperature, top_p, ids_B_Sp.shape[1], ids_B_Sp.device)
        gen_cfg = GenerationConfig(
            do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id, bos_token_id=self.tokenizer.bos_token_id, disable_compile=True,
        )
        was_training = self.model.training
        self.model.eval()
        try:
            out_B_S = self.model.generate(
                input_ids=ids_B_Sp, attention_mask=mask_B_Sp, generation_config=gen_cfg,
                logits_processor=LogitsProcessorList([sampler]),
            )
        finally:
            self.model.train(was_training)
        comp_B_T = out_B_S[:, ids_B_Sp.shape[1]:]
        return comp_B_T, sampler.finish(comp_B_T)


def _right_pad_cat(tensors: list[torch.Tensor], value) -> torch.Tensor:
    width = max(t.shape[1] for t in tensors)
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value) for t in tensors])


def _left_pad_cat(tensors: list[torch.Tensor], value) -> torch.Tensor:
    width = max(t.shape[1] for t in tensors)
    return torch.cat([torch.nn.functional.pad(t, (width - t.shape[1], 0), value=value) for t in tensors])


def _concat(parts, prompt_index_B, pad_id) -> Rollout:
    ids, pm, comp, cm, logp, trunc = zip(*parts)
    return Rollout(
        prompt_ids_B_Sp=_left_pad_cat(list(ids), pad_id),
        prompt_mask_B_Sp=_left_pad_cat(list(pm), 0),
        completion_ids_B_T=_right_pad_cat(list(comp), pad_id),
        completion_mask_B_T=_right_pad_cat(list(cm), 0.0),
        sampling_logp_B_T=_right_pad_cat(list(logp), 0.0),
        truncated_B=torch.cat(list(trunc)),
        prompt_index_B=prompt_index_B.to(comp[0].device),
    )


def make_engine(cfg, model, tokenizer) -> RolloutEngine:
    """The engine named by ``cfg.rollout.engine`` (HF: ``cfg.rollout.batch_size`` sequences per decode call)."""
    if cfg.rollout.engine == "hf":
        return HFEngine(model, tokenizer, static_cache=cfg.rollout.static_cache, batch_size=cfg.rollout.batch_size)
    from opdkit.vllm_engine import VLLMEngine  # optional extra

    return VLLMEngine(cfg, model, tokenizer)
