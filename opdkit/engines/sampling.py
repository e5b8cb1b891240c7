"""Seeded sampling: temperature, top-p, then Gumbel-max with counter-based noise.

The noise for token index ``t`` of a row is a hash of ``(row seed, t, vocabulary id)`` in integer
arithmetic, so it is the same on every device and for every batch composition: a sample depends
only on its seed and the model's logits. Imports nothing from opdkit.

Uniforms (``uniform_noise``) are float64 ``(k + 1/2) / 2**52`` for a 52-bit integer ``k``: exact
(the sum needs 53 significand bits, which float64 has), strictly inside (0, 1), and fine enough
near 1 that the largest Gumbel values (which decide the argmax) are not visibly discretised.
(A float32 ``(k + 1/2) / 2**24`` rounds to exactly 1.0 for ``k = 2**24 - 1``: a Gumbel of +inf, a
uniformly random token about once per 110 sampled tokens at V = 151,936.)
"""

from __future__ import annotations

import hashlib

import torch
from transformers import LogitsProcessor


def sample_seed(seed: int, step: int, index: int) -> int:
    """A stable 63-bit seed for sample ``index`` of ``step`` (the same on every machine)."""
    digest = hashlib.sha256(f"{seed}/{step}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def top_p_filter(logits_B_V: torch.Tensor, top_p: float) -> torch.Tensor:
    """Set logits outside the smallest set with cumulative probability >= top_p to -inf."""
    if top_p >= 1.0:
        return logits_B_V
    sorted_B_V, order_B_V = torch.sort(logits_B_V, descending=True, dim=-1)
    probs_B_V = sorted_B_V.softmax(dim=-1)
    remove_B_V = (probs_B_V.cumsum(dim=-1) - probs_B_V) >= top_p  # mass before this entry already >= top_p
    remove_B_V[:, 0] = False
    sorted_B_V = sorted_B_V.masked_fill(remove_B_V, float("-inf"))
    return torch.empty_like(logits_B_V).scatter_(-1, order_B_V, sorted_B_V)


# splitmix64 constants as signed int64 (torch integer arithmetic wraps modulo 2**64)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MIX1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MIX2 = 0x94D049BB133111EB - (1 << 64)
UNIFORM_BITS = 52  # float64 holds (k + 1/2) exactly for k < 2**52


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser: a bijection of int64 that scrambles every bit."""
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def uniform_noise(seeds_B: torch.Tensor, t, V: int) -> torch.Tensor:
    """(B, V) float64 uniforms strictly inside (0, 1) from ``(seed_b, t, v)`` by integer hashing.

    ``t`` (int or 0-dim int64 tensor) is the index of the token being sampled. Pure integer
    arithmetic: the same bits on CPU and GPU, and no generator state (so it can run inside a CUDA
    graph). The top 52 bits of the hash give ``(k + 1/2) * 2**-52``, exact in float64.
    """
    key_B = _mix64(seeds_B * _GOLDEN + t)  # one stream per (row, token index)
    v_V = torch.arange(V, device=seeds_B.device, dtype=torch.int64)
    bits_B_V = _mix64(key_B[:, None] + v_V[None, :] * _GOLDEN)
    return (_shr(bits_B_V, 64 - UNIFORM_BITS).double() + 0.5) * (2.0 ** -UNIFORM_BITS)


def mask_vocab(logits_B_V: torch.Tensor, n_vocab: int | None) -> torch.Tensor:
    """Logits with ids >= ``n_vocab`` (embedding rows no token maps to) set to -inf; as is if None."""
    if n_vocab is None or n_vocab >= logits_B_V.shape[-1]:
        return logits_B_V
    return logits_B_V.index_fill(-1, torch.arange(n_vocab, logits_B_V.shape[-1], device=logits_B_V.device),
                                 float("-inf"))


def perturbed_logits(raw_B_V: torch.Tensor, seeds_B: torch.Tensor, t, temperature: float, top_p: float,
                     n_vocab: int | None = None) -> torch.Tensor:
    """Tempered, top-p-filtered logits (ids < ``n_vocab`` only) plus Gumbel noise, float64: their
    argmax is a sample from the tempered, top-p-truncated softmax (greedy if temperature <= 0)."""
    raw_B_V = mask_vocab(raw_B_V, n_vocab)
    if temperature <= 0:
        return raw_B_V
    logits_B_V = top_p_filter(raw_B_V.double() / temperature, top_p)
    gumbel_B_V = -torch.log(-torch.log(uniform_noise(seeds_B, t, raw_B_V.shape[1])))
    return logits_B_V + gumbel_B_V


def raw_logprobs(raw_B_V: torch.Tensor, n_vocab: int | None = None) -> torch.Tensor:
    """Log-softmax of the raw logits (temperature 1, no top-p) over the ids < ``n_vocab``, (B, V)
    float32 (-inf on the masked ids): the scale of the recorded sampling-time log-probs."""
    return mask_vocab(raw_B_V.float(), n_vocab).log_softmax(dim=-1)


class SeededSampler(LogitsProcessor):
    """Per-row seeded sampling inside greedy ``generate``; records raw log-probs of chosen tokens."""

    def __init__(self, seeds: list[int], temperature: float, top_p: float, prompt_width: int, device,
                 n_vocab: int | None = None):
        self.seeds_B = torch.tensor(seeds, dtype=torch.int64, device=device)
        self.temperature, self.top_p, self.prompt_width, self.n_vocab = temperature, top_p, prompt_width, n_vocab
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
        self.prev_logp_B_V = raw_logprobs(raw_B_V, self.n_vocab)
        # float64 scores: generate's greedy argmax then picks what the static decoder's argmax picks
        return perturbed_logits(raw_B_V, self.seeds_B, t, self.temperature, self.top_p, self.n_vocab)

    def finish(self, completion_ids_B_T: torch.Tensor) -> torch.Tensor:
        """Log-probs of the sampled tokens, (B, T); call once after ``generate``."""
        T = completion_ids_B_T.shape[1]
        if len(self.logps) < T:
            self._record(completion_ids_B_T[:, len(self.logps)])
        if not T:
            return completion_ids_B_T.new_zeros((completion_ids_B_T.shape[0], 0), dtype=torch.float)
        return torch.stack(self.logps[:T], dim=1)
