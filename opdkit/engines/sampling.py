"""The student's sampling policy, and seeded sampling from it (Gumbel-max with counter-based noise).

The convention, one for every engine (HF ``generate``, the static decoder, vLLM) and for the
update: a rollout at ``temperature`` τ and ``top_p`` p samples from the policy

    π(v) = softmax(z / τ)(v) renormalised over the nucleus S, for v in S (0 outside S),

where z are the model's logits over the tokenizer's ids (padding rows of the embedding are not
ids) and S is the smallest set of ids, taken from the most probable down (equal logits: the lower
id first), whose mass under softmax(z / τ) reaches p (all ids at p = 1). Greedy decoding (τ <= 0) is the model's own
distribution, τ = 1 and p = 1, as vLLM treats it. ``policy_logits`` is that function of the
logits; each engine records log π of every sampled token (``policy_scores``), and the losses
differentiate log π computed the same way from the current logits (verl's convention for the
temperature, with top-p honoured too: S is recomputed, and a sampled token that falls outside it,
by rounding, has π = 0). At τ = 1 and p = 1 every function here returns its input's own values,
bit for bit.

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
    """Set logits outside the smallest set with cumulative probability >= top_p to -inf (any
    leading axes; the last is the vocabulary). The input itself when top_p >= 1.

    Ties: ids are taken from the most probable down and, among equal logits, the lower id first (a
    stable sort), so where the nucleus ends inside a run of equal logits it keeps their lower ids and
    drops the higher ones, on every device. The same rule in every opdkit engine and in the update
    (all go through here); vLLM's samplers break such ties their own way (docs/fidelity.md)."""
    if top_p >= 1.0:
        return logits_B_V
    sorted_B_V, order_B_V = torch.sort(logits_B_V, descending=True, stable=True, dim=-1)
    probs_B_V = sorted_B_V.softmax(dim=-1)
    before_B_V = probs_B_V.cumsum(dim=-1).sub_(probs_B_V)  # (in place here: tensors of this function's own)
    remove_B_V = before_B_V >= top_p  # mass before this entry already >= top_p
    remove_B_V[..., 0] = False
    sorted_B_V.masked_fill_(remove_B_V, float("-inf"))
    return torch.empty_like(logits_B_V).scatter_(-1, order_B_V, sorted_B_V)


def policy_settings(temperature: float, top_p: float) -> tuple[float, float]:
    """(τ, p) of the policy that sampling at ``temperature`` / ``top_p`` draws from: greedy
    (temperature <= 0) is the model's own distribution, (1.0, 1.0)."""
    if temperature <= 0:
        return 1.0, 1.0
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p!r}: expected 0 < top_p <= 1 (params key rollout.top_p)")
    return float(temperature), float(top_p)


def policy_logits(logits_B_V: torch.Tensor, temperature: float, top_p: float,
                  n_vocab: int | None = None) -> torch.Tensor:
    """The logits of the sampling policy π (module docstring), in the input's dtype and with its
    leading axes: ids >= ``n_vocab`` and ids outside the top-p nucleus -inf, divided by the
    temperature (greedy: 1). The input itself at τ = 1, p = 1 with no padding rows."""
    tau, p = policy_settings(temperature, top_p)
    z_B_V = mask_vocab(logits_B_V, n_vocab)
    if tau != 1.0:
        z_B_V = z_B_V / tau
    return top_p_filter(z_B_V, p)


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


def _mix64_(z: torch.Tensor) -> torch.Tensor:
    """``_mix64`` in place (``z`` is overwritten and returned): the same bits without the (B, V) temporaries
    of every step, which at V = 151,936 cost as much as the arithmetic."""
    z ^= _shr(z, 30)
    z *= _MIX1
    z ^= _shr(z, 27)
    z *= _MIX2
    z ^= _shr(z, 31)
    return z


def uniform_noise(seeds_B: torch.Tensor, t, V: int) -> torch.Tensor:
    """(B, V) float64 uniforms strictly inside (0, 1) from ``(seed_b, t, v)`` by integer hashing.

    ``t`` (int or 0-dim int64 tensor) is the index of the token being sampled. Pure integer
    arithmetic: the same bits on CPU and GPU, and no generator state (so it can run inside a CUDA
    graph). The top 52 bits of the hash give ``(k + 1/2) * 2**-52``, exact in float64.
    """
    key_B = _mix64(seeds_B * _GOLDEN + t)  # one stream per (row, token index)
    v_V = torch.arange(V, device=seeds_B.device, dtype=torch.int64)
    bits_B_V = _mix64_(key_B[:, None] + v_V[None, :] * _GOLDEN)
    u_B_V = _shr(bits_B_V, 64 - UNIFORM_BITS).double()
    u_B_V += 0.5
    u_B_V *= 2.0 ** -UNIFORM_BITS
    return u_B_V


def mask_vocab(logits_B_V: torch.Tensor, n_vocab: int | None) -> torch.Tensor:
    """Logits with ids >= ``n_vocab`` (embedding rows no token maps to) set to -inf; as is if None."""
    if n_vocab is None or n_vocab >= logits_B_V.shape[-1]:
        return logits_B_V
    return logits_B_V.index_fill(-1, torch.arange(n_vocab, logits_B_V.shape[-1], device=logits_B_V.device),
                                 float("-inf"))


def policy_scores(raw_B_V: torch.Tensor, seeds_B: torch.Tensor, t, temperature: float, top_p: float,
                  n_vocab: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sampling step from the raw logits (B, V): ``(scores_B_V, logp_B_V)``.

    ``scores_B_V`` (float64): the policy's logits plus token ``t``'s Gumbel noise (no noise when
    greedy); their argmax is a sample from π. ``logp_B_V`` (float32): log π over the same
    nucleus (taken from the float64 logits, so a sampled id is always inside it), -inf outside:
    the log-prob each engine records for the sampled token. The nucleus is chosen in float64,
    the log-probs in float32 as the update computes them (``policy_logits`` of fp32 logits).
    """
    z64_B_V = policy_logits(raw_B_V.double(), temperature, top_p, n_vocab)
    tau, _ = policy_settings(temperature, top_p)
    z32_B_V = raw_B_V.float() if tau == 1.0 else raw_B_V.float() / tau
    logp_B_V = z32_B_V.masked_fill(z64_B_V == float("-inf"), float("-inf")).log_softmax(dim=-1)
    if temperature <= 0:
        return z64_B_V, logp_B_V
    gumbel_B_V = uniform_noise(seeds_B, t, raw_B_V.shape[1]).log_().neg_().log_().neg_()  # -log(-log(u)), in place
    return gumbel_B_V.add_(z64_B_V), logp_B_V  # z + gumbel


class SeededSampler(LogitsProcessor):
    """Per-row seeded sampling inside greedy ``generate``; records log π of the chosen tokens."""

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
        # float64 scores: generate's greedy argmax then picks what the static decoder's argmax picks
        perturbed_B_V, self.prev_logp_B_V = policy_scores(scores.float(), self.seeds_B, t, self.temperature, self.top_p,
                                                          self.n_vocab)
        return perturbed_B_V

    def finish(self, completion_ids_B_T: torch.Tensor) -> torch.Tensor:
        """Log-probs of the sampled tokens, (B, T); call once after ``generate``."""
        T = completion_ids_B_T.shape[1]
        if len(self.logps) < T:
            self._record(completion_ids_B_T[:, len(self.logps)])
        if not T:
            return completion_ids_B_T.new_zeros((completion_ids_B_T.shape[0], 0), dtype=torch.float)
        return torch.stack(self.logps[:T], dim=1)
