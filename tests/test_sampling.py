"""The seeded sampler at the real vocabulary size (V = 151,936), against references computed
independently in numpy / scipy: uniforms strictly inside (0, 1), sampled-token frequencies equal to
the tempered, top-p-truncated softmax, never an id outside the top-p set or the tokenizer's ids."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from opdkit.engines.sampling import policy_scores, sample_seed, uniform_noise

V = 151_936  # Qwen2.5's head rows


@pytest.mark.slow
def test_no_uniform_is_0_or_1_over_1e8_draws_at_v_151936():
    """>= 10^8 draws over 660 rows (seeds) and many token indices; chunked (16 rows at a time)."""
    n_draws, lo, hi = 0, 1.0, 0.0
    for chunk in range(42):
        seeds_B = torch.tensor([sample_seed(7, chunk, i) for i in range(16)], dtype=torch.int64)
        u_B_V = uniform_noise(seeds_B, chunk * 97 + 3, V)  # token indices 3 .. 3977
        lo, hi = min(lo, float(u_B_V.min())), max(hi, float(u_B_V.max()))
        n_draws += u_B_V.numel()
    assert n_draws >= 1e8
    assert 0.0 < lo and hi < 1.0, (lo, hi)
    gumbel = -np.log(-np.log(np.array([lo, hi], dtype=np.float64)))
    assert np.isfinite(gumbel).all()


def _logits_V() -> torch.Tensor:
    """8 distinct 'real' logits at scattered ids (the last id among them), a random low tail."""
    g = np.random.default_rng(0)
    logits = g.normal(-8.0, 1.0, V)
    logits[TOP] = [3.0, 2.5, 2.0, 1.5, 1.0, 0.5, 0.0, -0.5]
    return torch.tensor(logits, dtype=torch.float32)


TOP = np.array([V - 1, 17, 151_643, 90_000, 4, 123_456, 60_001, 2])


def _reference(logits_V: np.ndarray, T: float, top_p: float) -> np.ndarray:
    """softmax(logits / T) truncated to the smallest prefix (by probability) with mass >= top_p."""
    z = logits_V.astype(np.float64) / T
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        k = int(np.searchsorted(cum, top_p) + 1)  # first prefix whose mass reaches top_p
        keep = np.zeros_like(p, dtype=bool)
        keep[order[:k]] = True
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    return p


def _draw(logits_V: torch.Tensor, n: int, T: float, top_p: float, rows: int = 100) -> np.ndarray:
    picks = []
    for start in range(0, n, rows):
        seeds_B = torch.tensor([sample_seed(11, 0, i) for i in range(start, start + rows)], dtype=torch.int64)
        picks.append(policy_scores(logits_V.expand(rows, V), seeds_B, 0, T, top_p)[0].argmax(-1).numpy())
    return np.concatenate(picks)


@pytest.mark.parametrize("T, top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_sampled_frequencies_match_the_truncated_softmax_at_v_151936(T, top_p):
    logits_V = _logits_V()
    p_V = _reference(logits_V.numpy(), T, top_p)
    n = 400
    picks = _draw(logits_V, n, T, top_p)
    assert (p_V[picks] > 0).all(), "an id outside the top-p set was drawn"
    # bins: each of the 8 named ids with expected count >= 5, everything else as one bin
    bins = [i for i in TOP if p_V[i] * n >= 5]
    observed = [int((picks == i).sum()) for i in bins]
    expected = [p_V[i] * n for i in bins]
    rest_p = 1.0 - sum(p_V[i] for i in bins)
    if rest_p * n >= 5:
        observed.append(n - sum(observed))
        expected.append(rest_p * n)
    else:
        assert n - sum(observed) <= max(5, 3 * rest_p * n + 3)
        observed, expected = observed, list(np.array(expected) / sum(expected) * sum(observed))
    assert len(observed) >= 2
    p_value = stats.chisquare(observed, expected).pvalue
    assert p_value > 1e-3, (observed, expected, p_value)


# --- ties at the nucleus' edge -------------------------------------------------------------------------------


def _numpy_nucleus(z: np.ndarray, top_p: float) -> set[int]:
    """The nucleus by the rule opdkit states: most probable first, equal logits lower id first (numpy's
    stable argsort of -z), the smallest prefix whose mass reaches top_p."""
    order = np.argsort(-z, kind="stable")
    p = np.exp(z - z.max())
    p = p[order] / p.sum()
    before = np.cumsum(p) - p
    return set(order[before < top_p].tolist())


def _vllm_pytorch_nucleus(z: np.ndarray, top_p: float) -> set[int]:
    """vLLM's PyTorch top-p (v1/sample/ops/topk_topp_sampler.py ``apply_top_k_top_p_pytorch``), re-written in
    numpy: ascending sort (equal logits in id order, as a stable sort gives them), drop the entries whose
    cumulative mass from the bottom is <= 1 - top_p, keep the last."""
    order = np.argsort(z, kind="stable")
    p = np.exp(z - z.max())
    cum = np.cumsum(p[order] / p.sum())
    drop = cum <= 1 - top_p
    drop[-1] = False
    return set(order[~drop].tolist())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_a_tie_at_the_nucleus_edge_keeps_the_lower_id_in_the_update_and_in_the_engines(dtype):
    """Three equal logits where the nucleus ends: the update's policy (policy_logits), and the engines'
    (policy_scores: HF generate, the static decoder) keep the lowest of the tied ids that fit, at the real
    vocabulary size too; vLLM's PyTorch rule, re-written from its code, keeps the highest instead."""
    from opdkit.engines.sampling import policy_logits

    z = np.full(V, -30.0)
    z[[9, 40_000, 151_000]] = 1.0  # tied
    z[77] = 1.5
    p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    top_p = float(p[77] + 1.5 * p[9])  # id 77, then one and a half of the tied ids' mass: two of the three fit
    assert _numpy_nucleus(z, top_p) == {77, 9, 40_000}
    assert _vllm_pytorch_nucleus(z, top_p) == {77, 40_000, 151_000}  # the other way round
    z_V = torch.tensor(z, dtype=dtype)
    kept = torch.isfinite(policy_logits(z_V, 1.0, top_p)).nonzero()[:, 0].tolist()
    assert set(kept) == {77, 9, 40_000}
    _, logp_1_V = policy_scores(z_V[None], torch.tensor([3]), 0, 1.0, top_p)
    assert set(torch.isfinite(logp_1_V[0]).nonzero()[:, 0].tolist()) == {77, 9, 40_000}
    # random logits with many ties (rounded to bf16's grid), many settings: always the stated rule
    g = np.random.default_rng(1)
    for trial in range(20):
        w = torch.tensor(g.normal(0, 2, 4096)).to(torch.bfloat16).double().numpy()
        tp = float(g.uniform(0.3, 0.99))
        got = set(torch.isfinite(policy_logits(torch.tensor(w, dtype=dtype), 1.0, tp)).nonzero()[:, 0].tolist())
        assert got == _numpy_nucleus(w, tp), trial
