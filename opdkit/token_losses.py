"""Sampled-token losses: pure tensor functions of the sampled tokens' log-probs (``*_B_T``),
each returning ``(loss, metrics)``, and the helpers every loss shares.

Each loss's expected gradient over the student's samples is the gradient of the divergence its
docstring names (checked in tests/test_losses.py by exact enumeration over small vocabularies):

- ``k1_loss``: PPO policy gradient, advantage A = log p_T - log p_S -> ∇KL(p_S || p_T).
- ``k2_loss``: 1/2 (log p_S - log p_T)^2 differentiated directly -> ∇KL(p_S || p_T).
- ``k3_loss``: r - 1 - log r (r = p_T / p_S) differentiated directly -> ∇KL(p_T || p_S).
- ``sft_loss``: negative log-likelihood of the given tokens (the SFT control).
- ``reward_pg_loss``: the verifiable reward's policy-gradient term (``opdkit.rewards``), PPO's
  surrogate with a per-token advantage λ A_b -> λ ∇E[r] (times P G / n_tokens; see ``opdkit.rewards``).

Normalisation, metrics and padding as described in ``opdkit.losses`` (which re-exports these).
p_S is the student policy the rollout samples (tempered, top-p-truncated; ``opdkit.loss_table``);
with top-p < 1, k3's forward KL runs over the student's nucleus S (its expected gradient is
-sum_{v in S} p_T(v) ∇log p_S(v) = ∇ sum_{v in S} p_T(v) log(p_T(v) / p_S(v))). A sampled token
with log p_S = -inf (outside the nucleus recomputed from the current logits: p_S = 0, so its
importance weight is 0) is left out, as if masked.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


# ----------------------------------------------------------------------------- helpers


def masked_sum(x_B_T: Tensor, mask_B_T: Tensor) -> Tensor:
    """Sum of ``x_B_T`` over positions where ``mask_B_T`` is nonzero (0-dim tensor, keeps grad).

    Padding values are selected away (not multiplied by 0), so inf/nan there do not leak.
    """
    assert x_B_T.shape == mask_B_T.shape, f"x {tuple(x_B_T.shape)} vs mask {tuple(mask_B_T.shape)}"
    return torch.where(mask_B_T != 0, x_B_T, torch.zeros_like(x_B_T)).sum()


def _check_n_tokens(n_tokens: float) -> float:
    n = float(n_tokens)
    assert n > 0, f"n_tokens must be > 0 (masked-in completion tokens of the whole step), got {n_tokens}"
    return n


def _floats(metrics: dict[str, Tensor]) -> dict[str, float]:
    """0-dim tensors -> python floats with one device sync."""
    values = torch.stack([v.detach().float().reshape(()) for v in metrics.values()]).tolist()
    return dict(zip(metrics.keys(), values))


def _mean(x_B_T: Tensor, mask_B_T: Tensor) -> Tensor:
    return masked_sum(x_B_T.detach(), mask_B_T) / mask_B_T.sum().clamp_min(1)



# ----------------------------------------------------------------------------- sampled-token losses


def _at_least_fp32(x: Tensor) -> Tensor:
    return x if x.dtype == torch.float64 else x.float()


def _sampled_inputs(logp_B_T, other_B_T, mask_B_T, n_tokens):
    """Shape checks, fp32 (or fp64), detach the ``other`` inputs and set their padding to the student's logp."""
    assert logp_B_T.dim() == 2, f"logp_B_T must be B x T, got {tuple(logp_B_T.shape)}"
    for name, x in other_B_T.items():
        assert x.shape == logp_B_T.shape, f"{name} {tuple(x.shape)} vs logp_B_T {tuple(logp_B_T.shape)}"
    assert mask_B_T.shape == logp_B_T.shape, f"mask_B_T {tuple(mask_B_T.shape)} vs {tuple(logp_B_T.shape)}"
    logp_B_T = _at_least_fp32(logp_B_T)
    # p_S = 0 (outside the top-p nucleus): weight 0; its -inf replaced so no inf * 0 reaches the gradient
    support_B_T = logp_B_T.detach() != float("-inf")  # NaN stays in (and is caught as non-finite)
    mask_B_T = (mask_B_T != 0) & support_B_T
    logp_B_T = torch.where(support_B_T, logp_B_T, torch.zeros_like(logp_B_T))
    s_B_T = logp_B_T.detach()
    others = [torch.where(mask_B_T, x.detach().to(s_B_T.dtype), s_B_T) for x in other_B_T.values()]
    return logp_B_T, s_B_T, others, mask_B_T, _check_n_tokens(n_tokens)


def _ppo_surrogate(logp_B_T, old_logp_B_T, adv_B_T, mask_B_T, n_tokens, clip_eps, dual_clip):
    """verl's ``compute_policy_loss`` per token, token-mean over the step.

    r = exp(logp - old_logp); l = max(-A r, -A clip(r, 1-eps, 1+eps)); with the dual clip c > 1
    (``dual_clip``; 0 = off), tokens with A < 0 take min(l, -c A), so a large ratio cannot push
    their loss (and gradient) without bound.
    """
    assert clip_eps >= 0, f"clip_eps must be >= 0 (loss.clip_eps), got {clip_eps}"
    if not (dual_clip == 0 or dual_clip > 1):
        raise ValueError(f"dual_clip={dual_clip!r}: expected 0 (off) or > 1 (params key loss.dual_clip)")
    ratio_B_T = torch.exp(logp_B_T - old_logp_B_T)
    unclipped_B_T = -adv_B_T * ratio_B_T
    clipped_B_T = -adv_B_T * torch.clamp(ratio_B_T, 1.0 - clip_eps, 1.0 + clip_eps)
    pg_B_T = torch.maximum(unclipped_B_T, clipped_B_T)
    dual_B_T = torch.zeros_like(mask_B_T)
    if dual_clip:
        bound_B_T = -adv_B_T * dual_clip
        dual_B_T = (adv_B_T < 0) & (bound_B_T < pg_B_T)
        pg_B_T = torch.where(dual_B_T, bound_B_T, pg_B_T)
    loss = masked_sum(pg_B_T, mask_B_T) / n_tokens
    with torch.no_grad():
        ratio_masked_B_T = torch.where(mask_B_T, ratio_B_T, torch.ones_like(ratio_B_T))
        metrics = {
            "advantage_mean": _mean(adv_B_T, mask_B_T),
            # clipped branch strictly larger: that token gets no gradient
            "ratio_clipped_frac": _mean((clipped_B_T > unclipped_B_T).float(), mask_B_T),
            "dual_clipped_frac": _mean(dual_B_T.float(), mask_B_T),
            "ratio_max": ratio_masked_B_T.max() if ratio_masked_B_T.numel() else torch.ones(()),
            "tokens": mask_B_T.sum().float(),
        }
    return loss, metrics


def _token_inputs(logp_B_T, old_logp_B_T, teacher_logp_B_T, mask_B_T, n_tokens):
    return _sampled_inputs(logp_B_T, {"old_logp_B_T": old_logp_B_T, "teacher_logp_B_T": teacher_logp_B_T},
                           mask_B_T, n_tokens)


def k1_loss(logp_B_T, old_logp_B_T, teacher_logp_B_T, mask_B_T, n_tokens, clip_eps, *, dual_clip=0.0,
            reward_adv_B_T=None):
    """PPO-clipped policy gradient with per-token advantage A = teacher_logp - logp.detach().

    Expected gradient (tokens sampled from the student, step on-policy or within the clip):
    ∇ KL(p_S || p_T), the reverse KL, since E_{p_S}[∇log p_S (log p_S - log p_T)] is its gradient.
    Shapes: all ``B_T``. ``logp_B_T``: student log-probs of the sampled tokens (with grad);
    ``old_logp_B_T``: sampling-time log-probs (no grad; the ratio exp(logp - old_logp) is the
    importance weight of an off-policy step); ``teacher_logp_B_T``: teacher log-probs of the same
    tokens. ``dual_clip``: see ``_ppo_surrogate``. ``reward_adv_B_T`` (OPD plus a verifiable reward,
    ``opdkit.rewards``): λ A_b on every token of completion b, added to the advantage (None: none).
    Metrics: ``kl`` (mean logp - teacher_logp, sampled reverse KL), ``advantage_mean``,
    ``ratio_clipped_frac``, ``dual_clipped_frac``, ``ratio_max`` (1.0 if no token), ``tokens``.
    """
    if reward_adv_B_T is None:
        logp_B_T, s_B_T, (old_B_T, t_B_T), mask_B_T, n = _token_inputs(
            logp_B_T, old_logp_B_T, teacher_logp_B_T, mask_B_T, n_tokens)
        adv_B_T = t_B_T - s_B_T
    else:
        logp_B_T, s_B_T, (old_B_T, t_B_T, r_B_T), mask_B_T, n = _sampled_inputs(
            logp_B_T, {"old_logp_B_T": old_logp_B_T, "teacher_logp_B_T": teacher_logp_B_T,
                       "reward_adv_B_T": reward_adv_B_T}, mask_B_T, n_tokens)
        adv_B_T = t_B_T - s_B_T + torch.where(mask_B_T, r_B_T, torch.zeros_like(r_B_T))
    loss, metrics = _ppo_surrogate(logp_B_T, old_B_T, adv_B_T, mask_B_T, n, clip_eps, dual_clip)
    metrics["kl"] = _mean(s_B_T - t_B_T, mask_B_T)
    return loss, _floats(metrics)


def reward_pg_loss(logp_B_T, old_logp_B_T, reward_adv_B_T, mask_B_T, n_tokens, clip_eps, *, dual_clip=0.0):
    """The verifiable reward's policy-gradient term beside a distillation loss (``opdkit.rewards``):
    PPO's surrogate (``_ppo_surrogate``, as k1's) with the per-token advantage ``reward_adv_B_T`` =
    λ A_b on every token of completion b, token sum over ``n_tokens``.

    Expected gradient (on-policy, n fixed): -(λ / n) E[sum_b A_b ∇log p_S(y_b)], which is
    -λ (B / n) ∇E[r] with the leave-one-out baseline and (G-1)/G of that with the group mean. Shapes:
    all ``B_T``; ``logp_B_T`` with grad, the others constants. Metrics: ``ratio_clipped_frac``,
    ``tokens``.
    """
    logp_B_T, _, (old_B_T, r_B_T), mask_B_T, n = _sampled_inputs(
        logp_B_T, {"old_logp_B_T": old_logp_B_T, "reward_adv_B_T": reward_adv_B_T}, mask_B_T, n_tokens)
    r_B_T = torch.where(mask_B_T, r_B_T, torch.zeros_like(r_B_T))
    loss, m = _ppo_surrogate(logp_B_T, old_B_T, r_B_T, mask_B_T, n, clip_eps, dual_clip)
    return loss, _floats({"ratio_clipped_frac": m["ratio_clipped_frac"], "tokens": m["tokens"]})


def _weighted_estimator(est_B_T, logp_B_T, old_B_T, mask_B_T, n):
    """sum of sg(r) * est over masked tokens / n, r = exp(logp - old_logp) (the importance weight)."""
    w_B_T = torch.exp(logp_B_T.detach() - old_B_T)
    loss = masked_sum(w_B_T * est_B_T, mask_B_T) / n
    ratio_max = torch.where(mask_B_T, w_B_T, torch.ones_like(w_B_T)).max() if w_B_T.numel() else torch.ones(())
    return loss, {"ratio_max": ratio_max, "tokens": mask_B_T.sum().float()}


def k2_loss(logp_B_T, old_logp_B_T, teacher_logp_B_T, mask_B_T, n_tokens):
    """k2 = 1/2 (log p_S - log p_T)^2 of each sampled token, differentiated directly.

    Expected gradient: ∇ KL(p_S || p_T), the reverse KL: E_{p_S}[(log p_S - log p_T) ∇log p_S].
    Each token is weighted by sg(exp(logp - old_logp)), the importance weight of a sampling
    policy that is not the current student (1 on-policy; it keeps the expectation exact
    off-policy). Shapes as in ``k1_loss``. Metrics: ``kl`` (k1 estimate, mean logp - teacher_logp),
    ``k2`` (mean k2), ``ratio_max``, ``tokens``.
    """
    logp_B_T, s_B_T, (old_B_T, t_B_T), mask_B_T, n = _token_inputs(
        logp_B_T, old_logp_B_T, teacher_logp_B_T, mask_B_T, n_tokens)
    k2_B_T = 0.5 * (logp_B_T - t_B_T) ** 2
    loss, metrics = _weighted_estimator(k2_B_T, logp_B_T, old_B_T, mask_B_T, n)
    metrics["kl"] = _mean(s_B_T - t_B_T, mask_B_T)
    metrics["k2"] = _mean(k2_B_T, mask_B_T)
    return loss, _floats(metrics)


def k3_loss(logp_B_T, old_logp_B_T, teacher_logp_B_T, mask_B_T, n_tokens):
    """k3 = r - 1 - log r, r = p_T / p_S, of each sampled token, differentiated directly.

    Expected gradient: ∇ KL(p_T || p_S), the FORWARD KL: ∇k3 = (1 - r) ∇log p_S and
    E_{p_S}[(1 - r) ∇log p_S] = -sum_v p_T ∇log p_S. (Its value estimates the reverse KL,
    E_{p_S}[k3] = KL(p_S || p_T), but its gradient does not; and -k3 as a stop-gradient reward
    in a policy gradient has expected gradient ∇KL(p_S || p_T) - ∇KL(p_T || p_S), no divergence:
    Tang & Munos 2025, "On a few pitfalls in KL divergence gradient estimation for RL", arXiv 2506.09477.)
    Importance weight and shapes as in ``k2_loss``. Metrics: ``kl`` (k1 estimate), ``k3`` (mean
    k3, an estimate of KL(p_S || p_T)), ``ratio_max``, ``tokens``.
    """
    logp_B_T, s_B_T, (old_B_T, t_B_T), mask_B_T, n = _token_inputs(
        logp_B_T, old_logp_B_T, teacher_logp_B_T, mask_B_T, n_tokens)
    log_r_B_T = t_B_T - logp_B_T
    k3_B_T = torch.expm1(log_r_B_T) - log_r_B_T
    loss, metrics = _weighted_estimator(k3_B_T, logp_B_T, old_B_T, mask_B_T, n)
    metrics["kl"] = _mean(s_B_T - t_B_T, mask_B_T)
    metrics["k3"] = _mean(k3_B_T, mask_B_T)
    return loss, _floats(metrics)


def sft_loss(logp_B_T, mask_B_T, n_tokens):
    """Negative log-likelihood of the given tokens; ``logp_B_T`` (B_T, with grad).

    Metrics: ``nll`` (mean over masked tokens), ``tokens``.
    """
    logp_B_T, _, _, mask_B_T, n = _sampled_inputs(logp_B_T, {}, mask_B_T, n_tokens)
    loss = masked_sum(-logp_B_T, mask_B_T) / n
    return loss, _floats({"nll": _mean(-logp_B_T, mask_B_T), "tokens": mask_B_T.sum().float()})
