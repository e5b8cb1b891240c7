"""Distillation losses: pure tensor functions, each returning ``(loss, metrics)``.

Sampled-token losses (log-probs of the sampled completion tokens, ``*_B_T``); each one's expected
gradient over the student's samples is the gradient of the divergence its docstring names:

- ``k1_loss``: PPO policy gradient, advantage A = log p_T - log p_S (tinker-cookbook's "reverse KL
  as reward"); expected gradient ∇KL(p_S || p_T).
- ``k2_loss``: 1/2 (log p_S - log p_T)^2 differentiated directly; expected gradient ∇KL(p_S || p_T).
- ``k3_loss``: r - 1 - log r, r = p_T / p_S, differentiated directly; expected gradient
  ∇KL(p_T || p_S) (forward KL).
- ``sft_loss``: negative log-likelihood of the given tokens (the SFT control).

(defined in ``opdkit.token_losses``, re-exported here).

Full-distribution losses (the student policy's logits and teacher log-probs over the vocabulary,
``*_B_T_V``; p_S is the tempered, top-p-truncated student policy, -inf logits outside its nucleus
S, see ``opdkit.loss_table``; with top-p < 1 the forward-KL sums run over S):

- ``fkl_loss``: forward KL(p_T || p_S) per position (mode-covering).
- ``rkl_loss``: reverse KL(p_S || p_T) per position (mode-seeking), exact over the vocabulary.
- ``jsd_loss``: generalized JSD of GKD (beta=0: forward KL, beta=1: reverse KL).
- ``topk_fkl_loss``: forward KL over the teacher's top-K ids, plus one tail bucket.
- ``topk_rkl_loss``: reverse KL over the student's top-K ids, both renormalised there
  (``opdkit.topk_losses``, re-exported here).

Normalisation: every loss takes ``n_tokens``, the number of masked-in completion tokens in the
whole optimizer step (all micro-batches), and returns ``sum of per-token loss / n_tokens``; the
losses of a step's micro-batches therefore add up to the step's token mean.

Clipping (fkl / rkl / jsd, ``clip`` and ``tau``): ``"entry"`` replaces each per-vocabulary
summand of the divergence by ``min(summand, tau)`` (a clipped entry is the constant tau, no
gradient); ``"token"`` scales each position's divergence by ``min(1, tau / div).detach()`` (value
capped at tau, gradient direction kept).

Metrics are detached python floats. Means are over this call's masked-in tokens (not divided by
``n_tokens``); ``tokens`` is that count, to weight means when combining micro-batches. ``kl`` (the
contract's key) is always the unclipped *reverse* KL(student || teacher) per token (sampled k1
estimate for k1/k2/k3); ``kl_forward`` (fkl / rkl / jsd) is the unclipped *forward* KL(teacher ||
student), the quantity the OPSD log's ``kl`` ("[OPSD kl]") tracks: read its 0.098 -> 0.199 against
``kl_forward``, never against ``kl``.
Teacher inputs are constants (detached). Padding positions of the detached inputs are replaced by
the student's own values, so garbage (inf/nan) there cannot reach the loss or its gradient.
Computation is in fp32 (fp64 inputs stay fp64).
"""

from __future__ import annotations

import math

import torch

from opdkit.token_losses import (  # noqa: F401
    _check_n_tokens,
    _floats,
    _mean,
    k1_loss,
    k2_loss,
    k3_loss,
    masked_sum,
    reward_pg_loss,
    sft_loss,
)
from opdkit.topk_losses import topk_diagnostics, topk_rkl_loss  # noqa: F401

Tensor = torch.Tensor
CLIPS = ("none", "entry", "token")


# ----------------------------------------------------------------------------- helpers


def entry_clip_terms(terms_B_T_V: Tensor, tau: float) -> tuple[Tensor, Tensor]:
    """Per-vocabulary-entry clip (OPSD): each summand becomes ``min(term, tau)``.

    Returns ``(clipped_terms_B_T_V, clipped_mask_B_T_V)``; an entry is clipped when ``term > tau``
    and then contributes the constant ``tau`` with zero gradient. ``tau=inf`` clips nothing,
    ``tau=0`` clips every positive entry.
    """
    assert terms_B_T_V.dim() == 3, f"terms_B_T_V must be B x T x V, got {tuple(terms_B_T_V.shape)}"
    clipped_mask_B_T_V = terms_B_T_V > tau
    tau_t = torch.tensor(tau, dtype=terms_B_T_V.dtype, device=terms_B_T_V.device)
    return torch.where(clipped_mask_B_T_V, tau_t, terms_B_T_V), clipped_mask_B_T_V


def clipped_mass(teacher_logp_B_T_V: Tensor, clipped_mask_B_T_V: Tensor, mask_B_T: Tensor) -> Tensor:
    """Mean over masked-in positions of the teacher probability mass in clipped entries (0-dim, detached)."""
    B, T, V = teacher_logp_B_T_V.shape
    assert clipped_mask_B_T_V.shape == (B, T, V) and mask_B_T.shape == (B, T)
    with torch.no_grad():
        p_T_B_T_V = teacher_logp_B_T_V.float().exp()
        mass_B_T = torch.where(clipped_mask_B_T_V, p_T_B_T_V, torch.zeros_like(p_T_B_T_V)).sum(-1)
        return masked_sum(mass_B_T, mask_B_T) / (mask_B_T != 0).sum().clamp_min(1)


def _fkl_terms(student_logp: Tensor, teacher_logp: Tensor) -> Tensor:
    """Summands p_T (log p_T - log p_S) of KL(p_T || p_S) over the last axis: 0 where p_T = 0, and
    over the student's support only (0 where log p_S = -inf: outside its top-p nucleus)."""
    p_T = teacher_logp.exp()
    keep = (p_T > 0) & (student_logp != float("-inf"))
    return torch.where(keep, p_T * (teacher_logp - student_logp), torch.zeros_like(p_T))


def _rkl_terms(student_logp: Tensor, teacher_logp: Tensor) -> Tensor:
    """Summands p_S (log p_S - log p_T) of KL(p_S || p_T) over the last axis (0 where p_S = 0; the
    difference is zeroed there before the product, so log p_S = -inf gives no inf * 0 in the gradient)."""
    p_S = student_logp.exp()
    return p_S * torch.where(p_S > 0, student_logp - teacher_logp, torch.zeros_like(p_S))


def _jsd_terms(student_logp: Tensor, teacher_logp: Tensor, beta: float) -> Tensor:
    """Summands of beta KL(p_T || m) + (1 - beta) KL(p_S || m), m = beta p_T + (1 - beta) p_S."""
    if beta == 0.0:
        return _fkl_terms(student_logp, teacher_logp)
    if beta == 1.0:
        return _rkl_terms(student_logp, teacher_logp)
    # an entry outside both supports (log p = -inf in both: outside the student's top-p nucleus at a position
    # whose teacher row is the detached student, e.g. past the completion's end) has log m = -inf, and
    # logaddexp(-inf, -inf)'s gradient is NaN even times 0: such entries go through logaddexp as 0 and are -inf after
    out_of_both = (teacher_logp == float("-inf")) & (student_logp == float("-inf"))
    zero = torch.zeros_like(student_logp)
    log_m = torch.logaddexp(torch.where(out_of_both, zero, teacher_logp + math.log(beta)),
                            torch.where(out_of_both, zero, student_logp + math.log(1.0 - beta)))
    log_m = torch.where(out_of_both, torch.full_like(log_m, float("-inf")), log_m)
    return beta * _fkl_terms(log_m, teacher_logp) + (1.0 - beta) * _rkl_terms(student_logp, log_m)


def reverse_kl_per_token(student_logp_B_T_V: Tensor, teacher_logp_B_T_V: Tensor) -> Tensor:
    """KL(p_S || p_T) at every position, ``B_T`` (differentiable in both inputs)."""
    assert student_logp_B_T_V.dim() == 3 and student_logp_B_T_V.shape == teacher_logp_B_T_V.shape
    return _rkl_terms(student_logp_B_T_V, teacher_logp_B_T_V).sum(-1)


def forward_kl_per_token(student_logp_B_T_V: Tensor, teacher_logp_B_T_V: Tensor) -> Tensor:
    """KL(p_T || p_S) at every position, ``B_T`` (differentiable in both inputs)."""
    assert student_logp_B_T_V.dim() == 3 and student_logp_B_T_V.shape == teacher_logp_B_T_V.shape
    return _fkl_terms(student_logp_B_T_V, teacher_logp_B_T_V).sum(-1)


def _check_logits(student_logits_B_T_V: Tensor) -> tuple[int, int, int]:
    shape = tuple(student_logits_B_T_V.shape)
    assert len(shape) == 3, f"student_logits_B_T_V must be B x T x V, got {shape}"
    return shape

def _topk_overlap_B_T(teacher_ids_B_T_k: Tensor, student_ids_B_T_k: Tensor) -> Tensor:
    """|teacher ids ∩ student ids| / k at every position (ids distinct within a position)."""
    same_B_T_k_k = teacher_ids_B_T_k[..., :, None] == student_ids_B_T_k[..., None, :]
    return same_B_T_k_k.any(-1).float().sum(-1) / teacher_ids_B_T_k.shape[-1]

# ----------------------------------------------------------------------------- full-distribution losses


def _full_inputs(student_logits_B_T_V, teacher_logp_B_T_V, mask_B_T, n_tokens, teacher_temperature=1.0):
    """Shape checks, fp32 log-softmax of the student, detached teacher with padding set to the student.

    ``teacher_temperature`` t: the teacher's distribution becomes softmax(z_T / t), from its log-probs
    (log_softmax(log p_T / t) = log_softmax(z_T / t)): the released OPSD, like TRL's GKD, tempers the teacher
    by its sampling temperature too. The student's logits come as the policy it samples (already tempered).
    """
    B, T, V = _check_logits(student_logits_B_T_V)
    t_shape = tuple(teacher_logp_B_T_V.shape)
    assert t_shape == (B, T, V), f"teacher_logp_B_T_V {t_shape}, want {(B, T, V)}"
    assert mask_B_T.shape == (B, T), f"mask_B_T {tuple(mask_B_T.shape)} vs {(B, T)}"
    assert teacher_temperature > 0, f"teacher_temperature must be > 0, got {teacher_temperature}"
    mask_B_T = mask_B_T != 0
    student_logp_B_T_V = torch.log_softmax(student_logits_B_T_V.float(), dim=-1)
    teacher_logp_B_T_V = teacher_logp_B_T_V.detach().float()
    if teacher_temperature != 1.0:
        teacher_logp_B_T_V = torch.log_softmax(teacher_logp_B_T_V / teacher_temperature, dim=-1)
    teacher_logp_B_T_V = torch.where(mask_B_T[..., None], teacher_logp_B_T_V, student_logp_B_T_V.detach())
    return student_logp_B_T_V, teacher_logp_B_T_V, mask_B_T, _check_n_tokens(n_tokens)


def _divergence_loss(terms_B_T_V, student_logp_B_T_V, teacher_logp_B_T_V, mask_B_T, n, clip, tau, k):
    """Sum the per-entry divergence terms per position, clip them, token-mean over the step.

    Metrics (shared by fkl/rkl/jsd): ``kl`` (unclipped reverse KL(p_S || p_T), mean over masked
    tokens), ``kl_forward`` (unclipped forward KL(p_T || p_S): what the OPSD log calls ``kl``),
    ``clipped_mass`` (entry clip: mean teacher probability mass in clipped entries; 0 for none/token),
    ``clipped_frac`` (entry: fraction of positions with any clipped entry; token: fraction of positions
    whose divergence exceeded tau; 0 for none),
    ``topk_overlap`` (mean |top-k(teacher) ∩ top-k(student)| / k, k = min(k, V)), ``tokens``.
    """
    if clip not in CLIPS:
        raise ValueError(f"clip={clip!r}: expected one of {CLIPS} (params key loss.clip)")
    if not tau >= 0:
        raise ValueError(f"tau={tau!r}: expected >= 0 (params key loss.clip_tau)")
    zero = torch.zeros((), device=terms_B_T_V.device)
    clip_mass, clip_frac = zero, zero
    if clip == "none":
        loss_B_T = terms_B_T_V.sum(-1)
    elif clip == "entry":
        clipped_terms_B_T_V, clipped_B_T_V = entry_clip_terms(terms_B_T_V, tau)
        loss_B_T = clipped_terms_B_T_V.sum(-1)
        clip_mass = clipped_mass(teacher_logp_B_T_V, clipped_B_T_V, mask_B_T)
        clip_frac = _mean(clipped_B_T_V.any(-1).float(), mask_B_T)
    else:  # token: value capped at tau, gradient scaled, direction kept
        div_B_T = terms_B_T_V.sum(-1)
        div_d_B_T = div_B_T.detach()
        over_B_T = div_d_B_T > tau
        scale_B_T = torch.where(over_B_T, tau / div_d_B_T, torch.ones_like(div_d_B_T))
        loss_B_T = div_B_T * scale_B_T
        clip_frac = _mean(over_B_T.float(), mask_B_T)
    loss = masked_sum(loss_B_T, mask_B_T) / n
    with torch.no_grad():
        s_B_T_V, t_B_T_V = student_logp_B_T_V.detach(), teacher_logp_B_T_V
        k = min(k, s_B_T_V.shape[-1])
        overlap_B_T = _topk_overlap_B_T(t_B_T_V.topk(k, -1).indices, s_B_T_V.topk(k, -1).indices)
        metrics = {
            "kl": _mean(reverse_kl_per_token(s_B_T_V, t_B_T_V), mask_B_T),
            "kl_forward": _mean(forward_kl_per_token(s_B_T_V, t_B_T_V), mask_B_T),
            "clipped_mass": clip_mass,
            "clipped_frac": clip_frac,
            "topk_overlap": _mean(overlap_B_T, mask_B_T),
            "tokens": mask_B_T.sum().float(),
        }
    return loss, metrics


def fkl_loss(student_logits_B_T_V, teacher_logp_B_T_V, mask_B_T, n_tokens, clip="none", tau=math.inf, *, k=8,
             teacher_temperature=1.0):
    """Forward KL(p_T || p_S) = sum_v p_T (log p_T - log p_S) per position, token-mean over the step.

    Exact over the vocabulary: its gradient is ∇KL(p_T || p_S) (unclipped).

    ``clip="entry"``: each summand -> min(p_T log(p_T / p_S), tau); ``clip="token"``: the position's
    KL times min(1, tau / KL).detach(). ``student_logits_B_T_V`` raw logits (with grad),
    ``teacher_logp_B_T_V`` normalised teacher log-probs, ``mask_B_T`` 1 = completion token.
    Metrics: ``kl``, ``kl_forward``, ``clipped_mass``, ``clipped_frac``, ``topk_overlap``, ``tokens``
    (defined in ``_divergence_loss``). ``teacher_temperature``: the teacher at softmax(z_T / t) (``_full_inputs``).
    """
    s_B_T_V, t_B_T_V, mask_B_T, n = _full_inputs(student_logits_B_T_V, teacher_logp_B_T_V, mask_B_T, n_tokens,
                                                 teacher_temperature)
    terms_B_T_V = _fkl_terms(s_B_T_V, t_B_T_V)
    loss, metrics = _divergence_loss(terms_B_T_V, s_B_T_V, t_B_T_V, mask_B_T, n, clip, tau, k)
    return loss, _floats(metrics)


def rkl_loss(student_logits_B_T_V, teacher_logp_B_T_V, mask_B_T, n_tokens, clip="none", tau=math.inf, *, k=8,
             teacher_temperature=1.0):
    """Reverse KL(p_S || p_T) = sum_v p_S (log p_S - log p_T) per position, token-mean over the step.

    Exact over the vocabulary: its gradient is ∇KL(p_S || p_T) (unclipped).

    ``clip="entry"``: each summand -> min(p_S log(p_S / p_T), tau) (summands can be negative; only
    the top is capped; ``clipped_mass`` still reports the teacher mass of clipped entries);
    ``clip="token"``: as in ``fkl_loss``. Shapes and metrics as in ``fkl_loss``.
    """
    s_B_T_V, t_B_T_V, mask_B_T, n = _full_inputs(student_logits_B_T_V, teacher_logp_B_T_V, mask_B_T, n_tokens,
                                                 teacher_temperature)
    terms_B_T_V = _rkl_terms(s_B_T_V, t_B_T_V)
    loss, metrics = _divergence_loss(terms_B_T_V, s_B_T_V, t_B_T_V, mask_B_T, n, clip, tau, k)
    return loss, _floats(metrics)


def jsd_loss(
    student_logits_B_T_V, teacher_logp_B_T_V, mask_B_T, n_tokens, beta, clip="none", tau=math.inf, *, k=8,
    teacher_temperature=1.0,
):
    """Generalized JSD (GKD, TRL ``generalized_jsd_loss``) per position, token-mean over the step.

    Exact over the vocabulary: its gradient is ∇JSD_beta(p_T, p_S) (unclipped).

    beta=0: exactly KL(p_T || p_S); beta=1: exactly KL(p_S || p_T); otherwise, with
    m = beta p_T + (1 - beta) p_S (in log space), beta KL(p_T || m) + (1 - beta) KL(p_S || m); the
    gradient flows through m too. ``clip="entry"`` caps each per-entry summand
    beta p_T log(p_T/m) + (1-beta) p_S log(p_S/m) at tau; ``clip="token"`` caps the position's JSD.
    Metrics as in ``fkl_loss`` plus ``jsd`` (unclipped, mean over masked tokens).
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta={beta!r}: expected 0 <= beta <= 1 (params key loss.jsd_beta)")
    s_B_T_V, t_B_T_V, mask_B_T, n = _full_inputs(student_logits_B_T_V, teacher_logp_B_T_V, mask_B_T, n_tokens,
                                                 teacher_temperature)
    terms_B_T_V = _jsd_terms(s_B_T_V, t_B_T_V, beta)
    loss, metrics = _divergence_loss(terms_B_T_V, s_B_T_V, t_B_T_V, mask_B_T, n, clip, tau, k)
    metrics["jsd"] = _mean(terms_B_T_V.detach().sum(-1), mask_B_T)
    return loss, _floats(metrics)


def topk_fkl_loss(
    student_logits_B_T_V, topk_ids_B_T_K, topk_logp_B_T_K, mask_B_T, n_tokens, tail_bucket=True, *, k=8
):
    """Forward KL over the teacher's top-K ids, token-mean over the step.

    Its gradient is that of KL(q_T || q_S) between the (K+1)-bucket (or renormalised K-way)
    versions q of both distributions: ∇KL(p_T || p_S) when the top-K holds all teacher mass.

    ``topk_ids_B_T_K``: the teacher's K (distinct) top token ids per position; ``topk_logp_B_T_K``:
    the teacher's normalised (full-vocabulary) log-probs of those ids. ``tail_bucket=True``: a
    (K+1)-way KL, the extra bucket holding the teacher's remaining mass 1 - sum_k p_T (taken as 0
    below the fp32 rounding noise K * eps; the K probs are renormalised if they sum past 1) and the
    student's exact remaining mass (logsumexp over the other ids, floored at fp32 tiny).
    ``tail_bucket=False``: both distributions renormalised over the K ids.
    Metrics: ``fkl_topk`` (the loss's divergence), ``rkl_topk`` (reverse KL of the same K(+1)-way
    distributions, teacher floored at fp32 tiny; a lower bound of the true reverse KL with the tail
    bucket; the exact ``kl`` is not available from top-K, so there is no ``kl`` key),
    ``teacher_topk_mass``, ``student_topk_mass`` (student mass on the teacher's ids),
    ``topk_overlap`` (the teacher's top-min(k, K) among its ids vs the student's top-min(k, K)),
    verl's ``teacher_mass`` / ``student_mass`` (the two masses above, under verl's names) and
    ``overlap_ratio`` (|teacher top-K ∩ student top-K| / K: ``topk_losses.topk_diagnostics``), ``tokens``.
    """
    B, T, V = _check_logits(student_logits_B_T_V)
    ids_shape = tuple(topk_ids_B_T_K.shape)
    assert len(ids_shape) == 3 and ids_shape[:2] == (B, T), f"topk_ids_B_T_K {ids_shape}, want {(B, T)} x K"
    K = ids_shape[-1]
    assert 0 < K <= V, f"K={K} must be in 1..V={V}"
    logp_shape = tuple(topk_logp_B_T_K.shape)
    assert logp_shape == (B, T, K), f"topk_logp_B_T_K {logp_shape}, want {(B, T, K)}"
    assert mask_B_T.shape == (B, T), f"mask_B_T {tuple(mask_B_T.shape)} vs {(B, T)}"
    mask_B_T = mask_B_T != 0
    n = _check_n_tokens(n_tokens)
    ids_B_T_K = topk_ids_B_T_K.long()
    log_tiny = math.log(torch.finfo(torch.float32).tiny)

    logits_B_T_V = student_logits_B_T_V.float()
    log_z_B_T = torch.logsumexp(logits_B_T_V, dim=-1)
    s_B_T_K = logits_B_T_V.gather(-1, ids_B_T_K) - log_z_B_T[..., None]
    raw_t_B_T_K = torch.where(mask_B_T[..., None], topk_logp_B_T_K.detach().float(), s_B_T_K.detach())

    if tail_bucket:
        t_B_T_K = raw_t_B_T_K - torch.logsumexp(raw_t_B_T_K, -1, keepdim=True).clamp_min(0.0)
        t_tail_B_T = 1.0 - t_B_T_K.exp().sum(-1)
        noise = K * torch.finfo(torch.float32).eps  # rounding noise of summing K probabilities
        t_tail_B_T = torch.where(t_tail_B_T > noise, t_tail_B_T, torch.zeros_like(t_tail_B_T))
        # student tail: exact log-mass of the ids outside the teacher's top-K
        in_topk_B_T_V = torch.zeros_like(logits_B_T_V, dtype=torch.bool).scatter_(-1, ids_B_T_K, True)
        rest_B_T_V = logits_B_T_V.masked_fill(in_topk_B_T_V, torch.finfo(torch.float32).min)
        s_tail_B_T = (torch.logsumexp(rest_B_T_V, -1) - log_z_B_T).clamp_min(log_tiny)
        t_B_T_K1 = torch.cat([t_B_T_K, t_tail_B_T.log()[..., None]], -1)  # log 0 = -inf: term is 0
        s_B_T_K1 = torch.cat([s_B_T_K, s_tail_B_T[..., None]], -1)
    else:
        t_B_T_K1 = raw_t_B_T_K - torch.logsumexp(raw_t_B_T_K, -1, keepdim=True)
        s_B_T_K1 = s_B_T_K - torch.logsumexp(s_B_T_K, -1, keepdim=True)

    div_B_T = _fkl_terms(s_B_T_K1, t_B_T_K1).sum(-1)
    loss = masked_sum(div_B_T, mask_B_T) / n
    with torch.no_grad():
        kk = min(k, K)
        teacher_top_B_T_k = ids_B_T_K.gather(-1, raw_t_B_T_K.topk(kk, -1).indices)
        overlap_B_T = _topk_overlap_B_T(teacher_top_B_T_k, logits_B_T_V.detach().topk(kk, -1).indices)
        metrics = {
            "fkl_topk": _mean(div_B_T, mask_B_T),
            # teacher log-probs floored at fp32 tiny, so an empty teacher tail gives a finite value
            "rkl_topk": _mean(_rkl_terms(s_B_T_K1.detach(), t_B_T_K1.clamp_min(log_tiny)).sum(-1), mask_B_T),
            "teacher_topk_mass": _mean(raw_t_B_T_K.exp().sum(-1), mask_B_T),
            "student_topk_mass": _mean(s_B_T_K.detach().exp().sum(-1), mask_B_T),
            "topk_overlap": _mean(overlap_B_T, mask_B_T),
            # verl's top-K diagnostics (opdkit.topk_losses): teacher_mass = teacher_topk_mass, student_mass =
            # student_topk_mass (kept under both names), overlap_ratio = |T ∩ student top-K| / K
            **topk_diagnostics(logits_B_T_V.detach() - log_z_B_T[..., None], ids_B_T_K, raw_t_B_T_K, mask_B_T),
            "tokens": mask_B_T.sum().float(),
        }
    return loss, _floats(metrics)
