"""Exact enumeration of the losses' expected gradients on tiny autoregressive policies, for the
statements opdkit makes about one-step-off rollouts (``rollout.overlap``) and the reward term
(``opdkit.overlap.OVERLAP_BIAS``, ``opdkit.rewards.VARIABLE_COUNT_BIAS``, docs/fidelity.md).

A policy is a table of logits, one V-vector per prefix (every prefix of length < T), with grad; the
teacher a table of log-probs. The expected gradient of a loss over the student's samples is the sum,
over every completion (every joint draw of a group, for the reward), of its probability (a constant)
times the gradient of opdkit's own loss function on it, through autograd. Everything is float64
except the full-vocabulary losses, which compute in float32 (opdkit.losses).

Used by tests/test_overlap_bias.py and bench/overlap_bias.py (which prints the tables).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import Counter

import torch

from opdkit import losses, rewards
from opdkit.engines.sampling import policy_logits

F64 = torch.float64


class Tabular:
    """Logits per prefix: ``z[prefix]`` (V,), every prefix of length 0..T-1 over ids 0..V-1."""

    def __init__(self, V: int, T: int, gen: torch.Generator, scale: float = 1.5):
        self.V, self.T = V, T
        self.prefixes = [p for t in range(T) for p in itertools.product(range(V), repeat=t)]
        self.z = {p: (scale * torch.randn(V, generator=gen, dtype=F64)).requires_grad_(True) for p in self.prefixes}

    def params(self) -> list[torch.Tensor]:
        return [self.z[p] for p in self.prefixes]

    def shifted(self, sd: float, gen: torch.Generator) -> dict:
        """The behaviour policy's logits: these plus N(0, sd^2) on every entry (constants)."""
        return {p: self.z[p].detach() + sd * torch.randn(self.V, generator=gen, dtype=F64) for p in self.prefixes}


def teacher_table(V: int, prefixes, gen: torch.Generator, scale: float = 1.5) -> dict:
    return {p: torch.log_softmax(scale * torch.randn(V, generator=gen, dtype=F64), -1) for p in prefixes}


def logp_table(z: dict, top_p: float = 1.0) -> dict:
    """log π per prefix: log_softmax of the (top-p-truncated) logits."""
    return {p: policy_logits(v, 1.0, top_p).log_softmax(-1) for p, v in z.items()}


def sequences(V: int, T: int):
    return list(itertools.product(range(V), repeat=T))


def seq_prob(lp: dict, y) -> torch.Tensor:
    return torch.stack([lp[y[:t]][y[t]] for t in range(len(y))]).sum().exp()


def _grad(total: torch.Tensor, pol: Tabular) -> torch.Tensor:
    """∇ total over every prefix's logits, flat (a prefix no completion reaches: 0)."""
    gs = torch.autograd.grad(total, pol.params(), allow_unused=True)
    return torch.cat([torch.zeros(pol.V, dtype=F64) if g is None else g.reshape(-1) for g in gs])


def groups(completions: list, G: int):
    """Every multiset of G completions with its number of orderings (the losses are symmetric in the
    group's samples, so each ordering has the same gradient)."""
    for combo in itertools.combinations_with_replacement(completions, G):
        counts = Counter(combo)
        yield list(combo), math.factorial(G) // math.prod(math.factorial(c) for c in counts.values())


# --- one loss, one sequence -------------------------------------------------------------------------------------

TOKEN = ("k1", "k1_noclip", "k2", "k3")
FULL = ("rkl", "fkl", "jsd", "topk_fkl")


def sequence_loss(kind: str, pol: Tabular, teacher: dict, old_lp: dict, y, top_p: float = 1.0) -> torch.Tensor:
    """opdkit's loss ``kind`` on completion ``y`` (one row of T tokens, n_tokens = T): the sampled-token
    losses with ``old_lp`` (the sampler's log-probs) as their importance reference."""
    T = len(y)
    one = torch.ones(1, T, dtype=F64)
    z_T_V = torch.stack([policy_logits(pol.z[y[:t]], 1.0, top_p) for t in range(T)])
    t_T_V = torch.stack([teacher[y[:t]] for t in range(T)])
    if kind in TOKEN:
        logp = z_T_V.log_softmax(-1).gather(-1, torch.tensor(y)[:, None])[:, 0][None]
        old = torch.stack([old_lp[y[:t]][y[t]] for t in range(T)])[None]
        teach = t_T_V.gather(-1, torch.tensor(y)[:, None])[:, 0][None]
        if kind == "k1":
            return losses.k1_loss(logp, old, teach, one, T, 0.2, dual_clip=3.0)[0]
        if kind == "k1_noclip":
            return losses.k1_loss(logp, old, teach, one, T, 1e9, dual_clip=0.0)[0]
        return getattr(losses, f"{kind}_loss")(logp, old, teach, one, T)[0]
    if kind == "topk_fkl":
        top = t_T_V.topk(2, -1)
        return losses.topk_fkl_loss(z_T_V[None], top.indices[None], top.values[None], one, T)[0]
    if kind == "jsd":
        return losses.jsd_loss(z_T_V[None], t_T_V[None], one, T, 0.5)[0]
    return getattr(losses, f"{kind}_loss")(z_T_V[None], t_T_V[None], one, T)[0]


def expected_grad(kind: str, pol: Tabular, teacher: dict, sampler_lp: dict, top_p: float = 1.0) -> torch.Tensor:
    """Σ_y q(y) ∇loss(y): completions drawn from the sampler ``sampler_lp`` (log-prob tables), whose
    log-probs the sampled-token losses take as their reference."""
    total = 0.0
    for y in sequences(pol.V, pol.T):
        q = float(seq_prob(sampler_lp, y))
        if q > 0:
            total = total + q * sequence_loss(kind, pol, teacher, sampler_lp, y, top_p)
    return _grad(total, pol)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


OVERLAP_KINDS = ("k1", "k1_noclip", "k2", "k3", "rkl", "fkl", "jsd")


def overlap_errors(sds, seed: int, V: int = 3, T: int = 2, kinds=OVERLAP_KINDS) -> dict:
    """Relative error of each loss's expected gradient when its completions are drawn one update
    behind (behaviour logits = current + N(0, sd^2) on every entry), against the same loss on-policy,
    for one random case (policy and teacher from ``seed``): {(kind, sd): error}."""
    gen = torch.Generator().manual_seed(seed)
    pol = Tabular(V, T, gen)
    teacher = teacher_table(V, pol.prefixes, gen)
    pi_lp = {p: v.detach() for p, v in logp_table(pol.z).items()}
    on = {k: expected_grad(k, pol, teacher, pi_lp) for k in kinds}
    out = {}
    for sd in sds:
        mu_lp = logp_table(pol.shifted(sd, torch.Generator().manual_seed(1000 * seed + int(1000 * sd))))
        out.update({(k, sd): rel(expected_grad(k, pol, teacher, mu_lp), on[k]) for k in kinds})
    return out


def overlap_table(sds=(0.15, 0.5), n_cases: int = 5, kinds=OVERLAP_KINDS) -> dict:
    """{(kind, sd): median relative error over ``n_cases`` random cases (seeds 0..n-1)}."""
    cases = [overlap_errors(sds, seed, kinds=kinds) for seed in range(n_cases)]
    return {key: statistics.median(c[key] for c in cases) for key in cases[0]}


# --- top-p < 1: ids the stale nucleus cannot reach ---------------------------------------------------------------

NUCLEUS_CASE = dict(current=[1.0, 0.8, 0.6, -2.0], behaviour=[1.3, 0.9, 0.3, -2.0], teacher=[0.0, 0.5, 1.5, 0.0],
                    top_p=0.8)  # current nucleus {0, 1, 2}; the behaviour's {0, 1}


def unreachable_errors(kinds=("k2", "k3", "k1_noclip", "rkl", "fkl")) -> dict:
    """One position (T = 1): the relative error of each loss's expected gradient when the completions come
    from the behaviour's nucleus, which lacks an id of the current one (``NUCLEUS_CASE``)."""
    c = NUCLEUS_CASE
    pol = Tabular(len(c["current"]), 1, torch.Generator().manual_seed(0))
    with torch.no_grad():
        pol.z[()].copy_(torch.tensor(c["current"], dtype=F64))
    teacher = {(): torch.log_softmax(torch.tensor(c["teacher"], dtype=F64), -1)}
    mu_lp = logp_table({(): torch.tensor(c["behaviour"], dtype=F64)}, c["top_p"])
    pi_lp = {p: v.detach() for p, v in logp_table(pol.z, c["top_p"]).items()}
    return {k: rel(expected_grad(k, pol, teacher, mu_lp, c["top_p"]), expected_grad(k, pol, teacher, pi_lp, c["top_p"]))
            for k in kinds}


# --- the reward term --------------------------------------------------------------------------------------------

LAMBDA = 0.7


def planted_reward(y) -> float:
    return 1.0 if y[-1] == 2 or y == (0, 0) else 0.0


def reward_term(logp_G_T, old_G_T, r_1_G, mask_G_T, n, baseline="loo", clip_eps=0.2, dual_clip=3.0):
    adv_G = rewards.group_advantages(r_1_G, baseline, "none")[0]
    G, T = logp_G_T.shape
    return losses.reward_pg_loss(logp_G_T, old_G_T, (LAMBDA * adv_G)[:, None].expand(G, T), mask_G_T, n,
                                 clip_eps=clip_eps, dual_clip=dual_clip)[0]


def _token_logp(pol: Tabular, y) -> torch.Tensor:
    return torch.stack([pol.z[y[:t]].log_softmax(-1)[y[t]] for t in range(len(y))])


def expected_reward_grad(pol: Tabular) -> torch.Tensor:
    """∇ E_{y ~ π}[r(y)], the sum over every completion: the independent reference."""
    e = sum(_token_logp(pol, y).sum().exp() * planted_reward(y) for y in sequences(pol.V, pol.T))
    return _grad(e, pol)


def reward_overlap_error(sd: float, seed: int, clip: bool, G: int = 3, V: int = 3, T: int = 2) -> float:
    """The reward term's expected gradient (leave-one-out baseline, PPO per-token ratio against the
    behaviour's log-probs, clipped at 0.2 or not) with the group drawn one update behind, against λ (G / n)
    ∇E_π[r] (n = G T tokens, fixed): the relative error."""
    gen = torch.Generator().manual_seed(seed)
    pol = Tabular(V, T, gen)
    mu_lp = logp_table(pol.shifted(sd, gen))
    ys = sequences(V, T)
    probs = {y: float(seq_prob(mu_lp, y)) for y in ys}
    kw = {} if clip else {"clip_eps": 1e9, "dual_clip": 0.0}
    total = 0.0
    for draw, orderings in groups(ys, G):
        q = orderings * math.prod(probs[y] for y in draw)
        logp_G_T = torch.stack([_token_logp(pol, y) for y in draw])
        old_G_T = torch.stack([torch.stack([mu_lp[y[:t]][y[t]] for t in range(T)]) for y in draw])
        r_1_G = torch.tensor([[planted_reward(y) for y in draw]], dtype=F64)
        total = total + q * reward_term(logp_G_T, old_G_T, r_1_G, torch.ones(G, T), G * T, **kw)
    got = -_grad(total, pol)
    return rel(got, LAMBDA * (G / (G * T)) * expected_reward_grad(pol))


def reward_overlap_table(sds=(0.15, 0.5), n_cases: int = 5) -> dict:
    """{(clip, sd): median relative error over ``n_cases`` random cases}."""
    return {(clip, sd): statistics.median(reward_overlap_error(sd, s, clip) for s in range(n_cases))
            for clip in (True, False) for sd in sds}


# --- the reward with a variable token count (completions that stop at EOS) ------------------------------------------

EOS = 0


def eos_completions(V: int = 3, T: int = 2) -> list[tuple]:
    """Every completion of at most T tokens that ends at its first EOS (id 0) or at T (truncated)."""
    out = []
    for y in sequences(V, T):
        cut = y.index(EOS) + 1 if EOS in y else T
        if tuple(y[:cut]) not in out:
            out.append(tuple(y[:cut]))
    return out


def eos_reward(y) -> float:
    return 1.0 if 2 in y else 0.0


def variable_count_error(G: int, seed: int = 0, baseline: str = "loo", V: int = 3, T: int = 2) -> float:
    """One prompt, G samples that stop at EOS; the reward term divided by the step's real token count n
    (a random variable), on-policy: its expected gradient against λ c (G / E[n]) ∇E[r], the identity with n
    replaced by its mean (c = 1 for loo, (G-1)/G for mean). The relative error."""
    gen = torch.Generator().manual_seed(seed)
    pol = Tabular(V, T, gen)
    lp = {p: v.detach() for p, v in logp_table(pol.z).items()}
    ys = eos_completions(V, T)
    probs = {y: float(seq_prob(lp, y)) for y in ys}
    total, mean_n = 0.0, 0.0
    for draw, orderings in groups(ys, G):
        q = orderings * math.prod(probs[y] for y in draw)
        n = sum(len(y) for y in draw)
        mean_n += q * n
        logp_G_T = torch.stack([torch.cat([_token_logp(pol, y), torch.zeros(T - len(y), dtype=F64)]) for y in draw])
        mask_G_T = torch.tensor([[1.0] * len(y) + [0.0] * (T - len(y)) for y in draw], dtype=F64)
        r_1_G = torch.tensor([[eos_reward(y) for y in draw]], dtype=F64)
        total = total + q * reward_term(logp_G_T, logp_G_T.detach(), r_1_G, mask_G_T, n, baseline)
    got = -_grad(total, pol)
    e_r = sum(_token_logp(pol, y).sum().exp() * eos_reward(y) for y in ys)
    grad_e_r = _grad(e_r, pol)
    c = 1.0 if baseline == "loo" else (G - 1) / G
    return rel(got, LAMBDA * c * (G / mean_n) * grad_e_r)
