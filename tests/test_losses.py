"""opdkit.losses against plain references (explicit loops, torch.distributions) and KL properties."""

import math

import pytest
import torch
from torch.distributions import Categorical, kl_divergence

from opdkit import losses

B, T, V = 2, 3, 7
MASK_B_T = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])  # one padding position
N_TOKENS = 9.0  # the whole step has more tokens than this micro-batch: normalisation is global
ATOL = 1e-5


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _full_inputs(seed=0, scale=2.0):
    g = _gen(seed)
    student_logits_B_T_V = (scale * torch.randn(B, T, V, generator=g)).requires_grad_(True)
    teacher_logp_B_T_V = torch.log_softmax(scale * torch.randn(B, T, V, generator=g), -1)
    teacher_logp_B_T_V[0, 2] = float("nan")  # garbage at the padding position must not leak
    return student_logits_B_T_V, teacher_logp_B_T_V


def _masked_positions():
    return [(b, t) for b in range(B) for t in range(T) if MASK_B_T[b, t] != 0]


def _grad(loss, x):
    (g,) = torch.autograd.grad(loss, x)
    return g


# ----------------------------------------------------------------------------- references


def _ref_kl(p_logits_or_logp, q_logits_or_logp):
    """KL(p || q) of two categorical distributions via torch.distributions."""
    return kl_divergence(Categorical(logits=p_logits_or_logp), Categorical(logits=q_logits_or_logp))


def _ref_terms(kind, s_logp_V, t_logp_V, beta=0.5):
    """Per-entry summands, one python-loop entry at a time (probabilities in linear space)."""
    terms = []
    for v in range(V):
        ps, pt = s_logp_V[v].exp(), t_logp_V[v].exp()
        if kind == "fkl":
            terms.append(pt * (t_logp_V[v] - s_logp_V[v]))
        elif kind == "rkl":
            terms.append(ps * (s_logp_V[v] - t_logp_V[v]))
        else:
            m = beta * pt + (1 - beta) * ps
            terms.append(beta * pt * torch.log(pt / m) + (1 - beta) * ps * torch.log(ps / m))
    return terms


def _ref_full_loss(kind, logits_B_T_V, teacher_logp_B_T_V, clip="none", tau=math.inf, beta=0.5):
    total = torch.zeros(())
    for b, t in _masked_positions():
        s_logp_V = torch.log_softmax(logits_B_T_V[b, t], -1)
        terms = _ref_terms(kind, s_logp_V, teacher_logp_B_T_V[b, t], beta)
        if clip == "entry":
            terms = [torch.minimum(x, torch.tensor(tau)) for x in terms]
        div = sum(terms)
        if clip == "token" and div.item() > tau:
            div = div * (tau / div.item())
        total = total + div
    return total / N_TOKENS


def _ref_sampled_loss(kind, logp_B_T, old_B_T, teacher_B_T, eps):
    """Per-token python loop: k1 the plain PPO surrogate (no dual clip); k2/k3 weighted by sg(ratio)."""
    total = torch.zeros(())
    for b, t in _masked_positions():
        s, tl = logp_B_T[b, t], teacher_B_T[b, t]
        ratio = torch.exp(s - old_B_T[b, t])
        if kind == "k1":
            adv = tl - s.detach()
            total = total - torch.minimum(ratio * adv, torch.clamp(ratio, 1 - eps, 1 + eps) * adv)
        elif kind == "k2":
            total = total + ratio.detach() * 0.5 * (s - tl) ** 2
        else:
            r = torch.exp(tl - s)
            total = total + ratio.detach() * (r - 1 - torch.log(r))
    return total / N_TOKENS


def _call_sampled(kind, logp, old, teacher, mask, n, **kw):
    if kind == "k1":
        return losses.k1_loss(logp, old, teacher, mask, n, kw.get("clip_eps", 0.2), dual_clip=kw.get("dual_clip", 0.0))
    return getattr(losses, f"{kind}_loss")(logp, old, teacher, mask, n)


def _sampled_inputs(seed=0):
    """Masked tokens cover every PPO case (eps = 0.2): ratio in range; ratio 1.65 or 0.61 with
    teacher above or below the student, so the clipped branch is taken at 2 of the 5 tokens."""
    g = _gen(seed)
    logp_B_T = (-2.0 - torch.rand(B, T, generator=g)).requires_grad_(True)
    log_ratio_B_T = torch.tensor([[0.05, 0.5, 0.0], [0.5, -0.5, -0.5]])
    teacher_minus_student_B_T = torch.tensor([[0.3, 0.3, 0.0], [-0.3, -0.3, 0.3]])
    old_B_T = logp_B_T.detach() - log_ratio_B_T
    teacher_B_T = logp_B_T.detach() + teacher_minus_student_B_T
    old_B_T[0, 2] = float("inf")  # garbage at padding
    teacher_B_T[0, 2] = float("nan")
    return logp_B_T, old_B_T, teacher_B_T


# ----------------------------------------------------------------------------- sampled-token losses


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_sampled_losses_match_reference_value_and_grad(kind):
    logp_B_T, old_B_T, teacher_B_T = _sampled_inputs()
    loss, m = _call_sampled(kind, logp_B_T, old_B_T, teacher_B_T, MASK_B_T, N_TOKENS)
    ref = _ref_sampled_loss(kind, logp_B_T, old_B_T, teacher_B_T, 0.2)
    assert torch.allclose(loss, ref, atol=ATOL)
    g, g_ref = _grad(loss, logp_B_T), _grad(ref, logp_B_T)
    assert torch.isfinite(g).all() and torch.allclose(g, g_ref, atol=ATOL)
    assert g[0, 2] == 0  # padding
    pos = _masked_positions()
    s = [logp_B_T[b, t].item() for b, t in pos]
    tl = [teacher_B_T[b, t].item() for b, t in pos]
    ratios = [math.exp(logp_B_T[b, t].item() - old_B_T[b, t].item()) for b, t in pos]
    assert m["kl"] == pytest.approx(sum(a - c for a, c in zip(s, tl)) / 5, abs=1e-5)
    assert m["ratio_max"] == pytest.approx(max(ratios), rel=1e-5)
    assert m["tokens"] == 5
    if kind == "k1":
        assert m["ratio_clipped_frac"] == pytest.approx(2 / 5)  # see _sampled_inputs
        assert m["advantage_mean"] == pytest.approx(-m["kl"], abs=1e-6)
    elif kind == "k2":
        assert m["k2"] == pytest.approx(sum(0.5 * (a - c) ** 2 for a, c in zip(s, tl)) / 5, abs=1e-6)
    else:
        assert m["k3"] == pytest.approx(sum(math.exp(c - a) - 1 - (c - a) for a, c in zip(s, tl)) / 5, abs=1e-6)


@pytest.mark.parametrize("mask_B_T", [MASK_B_T, torch.ones(B, T), torch.zeros(B, T)])
@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_sampled_teacher_equals_student_gives_zero(kind, mask_B_T):
    logp_B_T, old_B_T, _ = _sampled_inputs()
    loss, m = _call_sampled(kind, logp_B_T, old_B_T, logp_B_T.detach().clone(), mask_B_T, N_TOKENS, dual_clip=3.0)
    assert loss.item() == 0 and m["kl"] == 0 and m.get("advantage_mean", 0.0) == 0
    assert torch.equal(_grad(loss, logp_B_T), torch.zeros(B, T))


# ----------------------------------------------------------------------------- expected gradients (issue 14, point 2)


def _divergence_grads(theta_V, teacher_logp_V):
    """Autograd gradients w.r.t. the student logits of the exact KL(p_S || p_T) and KL(p_T || p_S)."""
    rkl = kl_divergence(Categorical(logits=theta_V), Categorical(logits=teacher_logp_V))
    fkl = kl_divergence(Categorical(logits=teacher_logp_V), Categorical(logits=theta_V))
    return torch.autograd.grad(rkl, theta_V)[0], torch.autograd.grad(fkl, theta_V)[0]


def _expected_grad(loss_of_token, theta_V, sampler_logp_V):
    """sum_v q(v) ∇ loss(v): the mean of the Monte Carlo gradient with token v ~ q (the sampler).

    ``loss_of_token(v, logp_1_1, old_1_1)`` is one sampled-token loss with the sampled token
    fixed to v; exact enumeration over the vocabulary, float64."""
    q_V = sampler_logp_V.exp()
    total_V = torch.zeros_like(theta_V)
    for v in range(theta_V.shape[0]):
        logp_1_1 = torch.log_softmax(theta_V, -1)[v].reshape(1, 1)
        loss = loss_of_token(v, logp_1_1, sampler_logp_V[v].reshape(1, 1))
        total_V += q_V[v] * torch.autograd.grad(loss, theta_V)[0]
    return total_V


def _categoricals(seed, V, off_policy):
    g = torch.Generator().manual_seed(seed)
    theta_V = (1.5 * torch.randn(V, generator=g, dtype=torch.float64)).requires_grad_(True)
    teacher_logp_V = torch.log_softmax(1.5 * torch.randn(V, generator=g, dtype=torch.float64), -1)
    old_V = theta_V.detach() + (0.5 * torch.randn(V, generator=g, dtype=torch.float64) if off_policy else 0.0)
    return theta_V, teacher_logp_V, torch.log_softmax(old_V, -1)


@pytest.mark.parametrize("off_policy", [False, True])
@pytest.mark.parametrize("V", [5, 17, 50])
@pytest.mark.parametrize("kind,target", [("k1", "rkl"), ("k2", "rkl"), ("k3", "fkl")])
def test_expected_gradient_is_the_named_divergence_gradient(kind, target, V, off_policy):
    """Σ_v q(v) ∇loss(v), tokens from the sampler q (the student; or an older policy, the step
    off-policy with the sampling log-probs as old_logp), equals autograd of the exact divergence
    at the current student: k1 and k2 -> KL(p_S || p_T), k3 -> KL(p_T || p_S). k1 off-policy
    without clipping (clip_eps = inf, dual clip off): the clip only ever bites off-policy."""
    for seed in range(3):
        theta_V, t_V, sampler_V = _categoricals(seed, V, off_policy)
        one = torch.ones(1, 1, dtype=torch.float64)
        kw = {"clip_eps": math.inf, "dual_clip": 0.0} if off_policy else {"clip_eps": 0.2, "dual_clip": 3.0}
        expected_V = _expected_grad(
            lambda v, logp, old, t_V=t_V, one=one, kw=kw: _call_sampled(kind, logp, old, t_V[v].reshape(1, 1), one,
                                                                        1.0, **kw)[0],
            theta_V, sampler_V)
        g_rkl, g_fkl = _divergence_grads(theta_V, t_V)
        want_V = g_rkl if target == "rkl" else g_fkl
        assert torch.allclose(expected_V, want_V, atol=1e-6, rtol=0), (expected_V - want_V).abs().max()
        assert (g_rkl - g_fkl).abs().max() > 1e-3  # the two targets are told apart


def test_sft_on_teacher_samples_has_the_forward_kl_gradient():
    theta_V, t_V, _ = _categoricals(0, 11, False)
    one = torch.ones(1, 1, dtype=torch.float64)
    expected_V = _expected_grad(lambda v, logp, old: losses.sft_loss(logp, one, 1.0)[0], theta_V, t_V)
    assert torch.allclose(expected_V, _divergence_grads(theta_V, t_V)[1], atol=1e-6, rtol=0)


def test_k3_as_a_stop_gradient_reward_climbs_the_forward_kl():
    """The form k3 had before (a policy gradient with reward -k3, stop-gradient) is no divergence's
    gradient: its expected gradient is ∇KL(p_S || p_T) - ∇KL(p_T || p_S) (Tang & Munos 2025)."""
    from opdkit.token_losses import _ppo_surrogate

    theta_V, t_V, sampler_V = _categoricals(0, 7, False)
    one = torch.ones(1, 1, dtype=torch.bool)

    def old_k3(v, logp, old):
        log_r = t_V[v].reshape(1, 1) - logp.detach()
        return _ppo_surrogate(logp, old, -(torch.expm1(log_r) - log_r), one, 1.0, 0.2, 0.0)[0]

    expected_V = _expected_grad(old_k3, theta_V, sampler_V)
    g_rkl, g_fkl = _divergence_grads(theta_V, t_V)
    assert torch.allclose(expected_V, g_rkl - g_fkl, atol=1e-6, rtol=0)
    assert (expected_V - g_rkl).abs().max() > 0.05 and (expected_V - g_fkl).abs().max() > 0.05


# ----------------------------------------------------------------------------- PPO dual clip (issue 14, point 9)


def _verl_pg_loss(adv, ratio, eps, c):
    """verl's compute_policy_loss (verl/trainer/ppo/core_algos.py) for one token, in plain floats:
    pg1 = -A r; pg2 = -A clip(r, 1 - eps, 1 + eps); l = max(pg1, pg2); for A < 0: min(-A c, l)."""
    clip_pg_losses1 = max(-adv * ratio, -adv * min(max(ratio, 1 - eps), 1 + eps))
    return min(-adv * c, clip_pg_losses1) if adv < 0 else clip_pg_losses1


@pytest.mark.parametrize("dual_clip", [3.0, 0.0])
def test_k1_dual_clip_matches_verl(dual_clip):
    """Every case: advantage +-, ratio below / inside / above the clip range and above c = 3.
    Values and gradients (central differences of the plain-python verl formula) per token."""
    eps, h = 0.2, 1e-6
    adv_N = [0.5, -0.5, 1.3, -1.3]
    log_ratio_N = [-1.0, -0.1, 0.1, 0.5, 1.5, 2.0]  # ratios 0.37, 0.90, 1.11, 1.65, 4.48, 7.39
    cases = [(a, lr) for a in adv_N for lr in log_ratio_N]
    c = dual_clip if dual_clip else math.inf
    old_B_T = torch.full((1, len(cases)), -2.0, dtype=torch.float64)
    logp_B_T = (old_B_T + torch.tensor([[lr for _, lr in cases]], dtype=torch.float64)).requires_grad_(True)
    teacher_B_T = logp_B_T.detach() + torch.tensor([[a for a, _ in cases]], dtype=torch.float64)
    mask_B_T = torch.ones_like(old_B_T)
    loss, m = losses.k1_loss(logp_B_T, old_B_T, teacher_B_T, mask_B_T, 1.0, eps, dual_clip=dual_clip)
    grad_N = _grad(loss, logp_B_T)[0].tolist()
    for i, (a, lr) in enumerate(cases):
        value = _verl_pg_loss(a, math.exp(lr), eps, c)
        slope = (_verl_pg_loss(a, math.exp(lr + h), eps, c) - _verl_pg_loss(a, math.exp(lr - h), eps, c)) / (2 * h)
        one_B_T = torch.zeros_like(mask_B_T)
        one_B_T[0, i] = 1
        got, _ = losses.k1_loss(logp_B_T, old_B_T, teacher_B_T, one_B_T, 1.0, eps, dual_clip=dual_clip)
        assert got.item() == pytest.approx(value, abs=1e-9), (a, lr)
        assert grad_N[i] == pytest.approx(slope, abs=1e-6), (a, lr)
    n_dual = sum(1 for a, lr in cases if a < 0 and math.exp(lr) > 3.0) if dual_clip else 0
    assert m["dual_clipped_frac"] == pytest.approx(n_dual / len(cases))
    if dual_clip:  # a negative advantage with a large ratio: bounded loss, no gradient
        assert n_dual == 4 and max(abs(g) for g, (a, lr) in zip(grad_N, cases) if a < 0 and lr > 1.2) == 0


def test_dual_clip_bad_value_raises():
    logp_B_T, old_B_T, teacher_B_T = _sampled_inputs()
    with pytest.raises(ValueError, match="loss.dual_clip"):
        losses.k1_loss(logp_B_T, old_B_T, teacher_B_T, MASK_B_T, N_TOKENS, 0.2, dual_clip=0.5)


def test_sft_loss():
    logp_B_T, _, _ = _sampled_inputs()
    loss, m = losses.sft_loss(logp_B_T, MASK_B_T, N_TOKENS)
    ref = -sum(logp_B_T[b, t] for b, t in _masked_positions()) / N_TOKENS
    assert torch.allclose(loss, ref, atol=ATOL)
    assert torch.allclose(_grad(loss, logp_B_T), -MASK_B_T / N_TOKENS)
    assert m["nll"] == pytest.approx(ref.item() * N_TOKENS / 5, abs=1e-5)


# ----------------------------------------------------------------------------- full-distribution losses


def _call(kind, logits, teacher, clip="none", tau=math.inf, beta=0.5, mask=MASK_B_T, n=N_TOKENS):
    if kind == "fkl":
        return losses.fkl_loss(logits, teacher, mask, n, clip=clip, tau=tau)
    if kind == "rkl":
        return losses.rkl_loss(logits, teacher, mask, n, clip=clip, tau=tau)
    return losses.jsd_loss(logits, teacher, mask, n, beta, clip=clip, tau=tau)


@pytest.mark.parametrize("clip,tau", [("none", math.inf), ("entry", 0.05), ("token", 0.3)])
@pytest.mark.parametrize("kind", ["fkl", "rkl", "jsd"])
def test_full_losses_match_reference_value_and_grad(kind, clip, tau):
    logits, teacher = _full_inputs()
    loss, m = _call(kind, logits, teacher, clip, tau, beta=0.3)
    ref = _ref_full_loss(kind, logits, teacher, clip, tau, beta=0.3)
    assert torch.allclose(loss, ref, atol=ATOL), (loss.item(), ref.item())
    g, g_ref = _grad(loss, logits), _grad(ref, logits)
    assert torch.isfinite(g).all() and torch.allclose(g, g_ref, atol=ATOL)
    assert torch.equal(g[0, 2], torch.zeros(V))  # padding
    if clip != "none":
        assert m["clipped_frac"] > 0  # tau chosen so that clipping happens


def test_full_metrics_match_torch_distributions():
    logits, teacher = _full_inputs()
    _, m = losses.jsd_loss(logits, teacher, MASK_B_T, N_TOKENS, beta=0.5)
    pos = _masked_positions()
    rkl = [_ref_kl(logits[b, t], teacher[b, t]).item() for b, t in pos]
    fkl = [_ref_kl(teacher[b, t], logits[b, t]).item() for b, t in pos]
    overlap = []
    for b, t in pos:
        top_t = set(teacher[b, t].topk(8 if V >= 8 else V).indices.tolist())
        top_s = set(logits[b, t].topk(8 if V >= 8 else V).indices.tolist())
        overlap.append(len(top_t & top_s) / len(top_t))
    assert m["kl"] == pytest.approx(sum(rkl) / 5, abs=1e-5)
    assert m["kl_forward"] == pytest.approx(sum(fkl) / 5, abs=1e-5)
    assert m["topk_overlap"] == pytest.approx(1.0)  # k = min(8, V) = V: everything overlaps
    assert m["tokens"] == 5 and m["clipped_mass"] == 0 and m["clipped_frac"] == 0
    _, m3 = losses.fkl_loss(logits, teacher, MASK_B_T, N_TOKENS, k=3)
    ref3 = []
    for b, t in pos:
        top_t = set(teacher[b, t].topk(3).indices.tolist())
        top_s = set(logits[b, t].topk(3).indices.tolist())
        ref3.append(len(top_t & top_s) / 3)
    assert m3["topk_overlap"] == pytest.approx(sum(ref3) / 5, abs=1e-6)


@pytest.mark.parametrize("clip", ["none", "entry", "token"])
@pytest.mark.parametrize("kind,beta", [("fkl", 0.5), ("rkl", 0.5), ("jsd", 0.0), ("jsd", 0.3), ("jsd", 1.0)])
def test_divergence_of_p_with_itself_is_zero(kind, beta, clip):
    logits, _ = _full_inputs()
    teacher = torch.log_softmax(logits.detach(), -1)
    loss, m = _call(kind, logits, teacher, clip, 0.01, beta)
    assert abs(loss.item()) < 1e-6 and abs(m["kl"]) < 1e-6 and abs(m["kl_forward"]) < 1e-6
    assert _grad(loss, logits).abs().max() < 1e-6


@pytest.mark.parametrize("clip,tau", [("none", math.inf), ("entry", 0.05), ("token", 0.3)])
def test_jsd_endpoints_equal_fkl_and_rkl(clip, tau):
    logits, teacher = _full_inputs()
    for beta, kind in [(0.0, "fkl"), (1.0, "rkl")]:
        loss_j, _ = _call("jsd", logits, teacher, clip, tau, beta)
        loss_k, _ = _call(kind, logits, teacher, clip, tau)
        assert torch.allclose(loss_j, loss_k, atol=1e-7)
        assert torch.allclose(_grad(loss_j, logits), _grad(loss_k, logits), atol=1e-7)
    # and the interior is in between the two Jensen-Shannon bounds: 0 < JSD(0.5) <= log 2
    loss_mid, m = _call("jsd", logits, teacher, beta=0.5)
    assert 0 < m["jsd"] <= math.log(2)


@pytest.mark.parametrize("kind", ["fkl", "rkl", "jsd"])
def test_entry_clip_tau_inf_equals_unclipped_and_tau_zero_clips_positive_entries(kind):
    logits, teacher = _full_inputs()
    loss_none, _ = _call(kind, logits, teacher)
    loss_inf, m_inf = _call(kind, logits, teacher, "entry", math.inf)
    assert torch.equal(loss_none, loss_inf) and m_inf["clipped_mass"] == 0 and m_inf["clipped_frac"] == 0
    assert torch.equal(_grad(loss_none, logits), _grad(loss_inf, logits))

    loss0, m0 = _call(kind, logits, teacher, "entry", 0.0)
    mass = []
    neg_sum = torch.zeros(())
    for b, t in _masked_positions():
        terms = _ref_terms(kind, torch.log_softmax(logits[b, t], -1), teacher[b, t])
        mass.append(sum(teacher[b, t, v].exp().item() for v in range(V) if terms[v].item() > 0))
        neg_sum = neg_sum + sum(x for x in terms if x.item() <= 0)
    assert m0["clipped_mass"] == pytest.approx(sum(mass) / 5, abs=1e-6)
    assert m0["clipped_frac"] == 1.0
    assert torch.allclose(loss0, neg_sum / N_TOKENS, atol=ATOL)  # only the non-positive terms remain


def test_entry_clip_helpers():
    terms = torch.tensor([[[0.5, -0.1, 0.2, 0.0]]])
    clipped, cmask = losses.entry_clip_terms(terms, 0.2)
    assert torch.equal(clipped, torch.tensor([[[0.2, -0.1, 0.2, 0.0]]]))
    assert cmask.tolist() == [[[True, False, False, False]]]
    teacher = torch.log(torch.tensor([[[0.4, 0.3, 0.2, 0.1]]]))
    assert losses.clipped_mass(teacher, cmask, torch.ones(1, 1)).item() == pytest.approx(0.4)
    assert losses.masked_sum(torch.tensor([[1.0, float("nan")]]), torch.tensor([[1, 0]])).item() == 1.0


@pytest.mark.parametrize("kind", ["fkl", "rkl", "jsd"])
def test_token_clip_caps_value_and_keeps_gradient_direction(kind):
    logits, teacher = _full_inputs()
    s = torch.log_softmax(logits, -1)
    per_tok = {"fkl": losses.forward_kl_per_token(s, teacher), "rkl": losses.reverse_kl_per_token(s, teacher)}
    for b, t in _masked_positions():  # one position at a time
        mask = torch.zeros(B, T)
        mask[b, t] = 1
        loss_none, _ = _call(kind, logits, teacher, mask=mask, n=1)
        tau = 0.5 * loss_none.item()
        loss_tok, m = _call(kind, logits, teacher, "token", tau, mask=mask, n=1)
        assert loss_tok.item() == pytest.approx(tau, rel=1e-6) and m["clipped_frac"] == 1
        assert m["clipped_mass"] == 0
        g_none, g_tok = _grad(loss_none, logits).flatten(), _grad(loss_tok, logits).flatten()
        cosine = torch.nn.functional.cosine_similarity(g_none, g_tok, dim=0).item()
        assert cosine == pytest.approx(1.0, abs=1e-6)
        assert g_tok.norm().item() == pytest.approx(0.5 * g_none.norm().item(), rel=1e-5)
        if kind in per_tok:
            assert loss_none.item() == pytest.approx(per_tok[kind][b, t].item(), rel=1e-5)
        # below the cap nothing changes
        loss_free, m_free = _call(kind, logits, teacher, "token", 2 * loss_none.item(), mask=mask, n=1)
        assert torch.equal(loss_free, loss_none) and m_free["clipped_frac"] == 0


def _topk_inputs(K, seed=0):
    logits, teacher = _full_inputs(seed)
    teacher[0, 2] = torch.log_softmax(torch.zeros(V), -1)  # topk needs non-nan scores to rank
    ids_B_T_K = teacher.topk(K, -1).indices
    return logits, teacher, ids_B_T_K, teacher.gather(-1, ids_B_T_K)


def test_topk_fkl_full_vocab_with_tail_equals_fkl():
    logits, teacher, ids, topk_logp = _topk_inputs(V)
    loss, m = losses.topk_fkl_loss(logits, ids, topk_logp, MASK_B_T, N_TOKENS, tail_bucket=True)
    loss_ref, m_ref = losses.fkl_loss(logits, teacher, MASK_B_T, N_TOKENS)
    assert torch.allclose(loss, loss_ref, atol=ATOL)
    assert torch.allclose(_grad(loss, logits), _grad(loss_ref, logits), atol=ATOL)
    assert m["teacher_topk_mass"] == pytest.approx(1.0, abs=1e-5)
    assert m["rkl_topk"] == pytest.approx(m_ref["kl"], abs=1e-4)


@pytest.mark.parametrize("tail_bucket", [True, False])
def test_topk_fkl_matches_bucketed_reference(tail_bucket):
    K = 3
    logits, teacher, ids, topk_logp = _topk_inputs(K)
    loss, m = losses.topk_fkl_loss(logits, ids, topk_logp, MASK_B_T, N_TOKENS, tail_bucket=tail_bucket)
    total, mass = torch.zeros(()), []
    for b, t in _masked_positions():
        p_s = torch.softmax(logits[b, t], -1)
        p_t = teacher[b, t].exp()
        top = ids[b, t].tolist()
        q_t = [p_t[i] for i in top]
        q_s = [p_s[i] for i in top]
        if tail_bucket:
            q_t.append(1 - sum(q_t))
            q_s.append(sum(p_s[i] for i in range(V) if i not in top))
        else:
            q_t = [x / sum(q_t) for x in q_t]
            q_s = [x / sum(q_s) for x in q_s]
        total = total + sum(a * torch.log(a / c) for a, c in zip(q_t, q_s))
        mass.append(sum(p_t[i].item() for i in top))
    ref = total / N_TOKENS
    assert torch.allclose(loss, ref, atol=ATOL)
    assert torch.allclose(_grad(loss, logits), _grad(ref, logits), atol=ATOL)
    assert m["teacher_topk_mass"] == pytest.approx(sum(mass) / 5, abs=1e-5)
    assert m["fkl_topk"] == pytest.approx(ref.item() * N_TOKENS / 5, abs=1e-5)
    assert 0 <= m["topk_overlap"] <= 1


def test_topk_fkl_same_distribution_is_zero():
    logits, _ = _full_inputs()
    teacher = torch.log_softmax(logits.detach(), -1)
    ids = teacher.topk(4, -1).indices
    for tail in (True, False):
        loss, m = losses.topk_fkl_loss(logits, ids, teacher.gather(-1, ids), MASK_B_T, N_TOKENS, tail)
        assert abs(loss.item()) < 1e-6 and _grad(loss, logits).abs().max() < 1e-6
        assert m["topk_overlap"] == 1.0


# ----------------------------------------------------------------------------- micro-batch additivity


def _all_losses(logits, teacher, logp, old, teacher_tok, mask, n):
    ids = teacher.nan_to_num(0.0).topk(3, -1).indices
    return {
        "k1": losses.k1_loss(logp, old, teacher_tok, mask, n, 0.2, dual_clip=3.0)[0],
        "k2": losses.k2_loss(logp, old, teacher_tok, mask, n)[0],
        "k3": losses.k3_loss(logp, old, teacher_tok, mask, n)[0],
        "sft": losses.sft_loss(logp, mask, n)[0],
        "fkl": losses.fkl_loss(logits, teacher, mask, n, clip="entry", tau=0.05)[0],
        "rkl": losses.rkl_loss(logits, teacher, mask, n, clip="token", tau=0.3)[0],
        "jsd": losses.jsd_loss(logits, teacher, mask, n, 0.5)[0],
        "topk_fkl": losses.topk_fkl_loss(logits, ids, teacher.gather(-1, ids), mask, n)[0],
    }


def test_micro_batches_add_up_to_the_step_loss():
    logits, teacher = _full_inputs()
    logp, old, teacher_tok = _sampled_inputs()
    n = MASK_B_T.sum().item()
    full = _all_losses(logits, teacher, logp, old, teacher_tok, MASK_B_T, n)
    halves = [
        _all_losses(logits[s], teacher[s], logp[s], old[s], teacher_tok[s], MASK_B_T[s], n)
        for s in (slice(0, 1), slice(1, 2))
    ]
    for name, loss in full.items():
        assert torch.allclose(halves[0][name] + halves[1][name], loss, atol=1e-6), name


def test_bad_arguments_raise():
    logits, teacher = _full_inputs()
    with pytest.raises(ValueError, match="loss.clip"):
        losses.fkl_loss(logits, teacher, MASK_B_T, N_TOKENS, clip="bogus")
    with pytest.raises(ValueError, match="loss.jsd_beta"):
        losses.jsd_loss(logits, teacher, MASK_B_T, N_TOKENS, beta=1.5)
    with pytest.raises(AssertionError, match="mask_B_T"):
        losses.rkl_loss(logits, teacher, MASK_B_T[:, :2], N_TOKENS)
    with pytest.raises(AssertionError, match="n_tokens"):
        losses.rkl_loss(logits, teacher, MASK_B_T, 0)
