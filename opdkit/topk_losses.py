"""The student's top-K reverse KL, and the top-K diagnostics every top-K loss logs (as verl defines them).

``topk_rkl_loss`` (``loss.name=topk_rkl``, verl issue 6676): at each completion position, S = the
student policy's top-K ids (K = ``loss.topk``; ids outside its top-p nucleus, p_S = 0, are left out
of S), both distributions renormalised over S,

    p̃_S(i) = p_S(i) / p_S(S),   p̃_T(i) = p_T(i) / p_T(S)   (i in S),
    L_t = KL(p̃_S || p̃_T) = sum_{i in S} p̃_S(i) (log p̃_S(i) - log p̃_T(i)),

token-mean over the step. Its gradient is that of KL(p̃_S || p̃_T) with S held fixed (S is the
arg-top-K of the logits: locally constant, so this is the gradient almost everywhere): with respect
to the student's logit z_j, p̃_S(j) (log(p̃_S(j) / p̃_T(j)) - L_t) for j in S and 0 for j outside S.
So the loss sees only the shape of p_S inside S: the mass p_S moves out of S, and every id outside
it, get no gradient (``student_support_mass`` shows that mass). It is exact at each sampled prefix
(no sampling over the vocabulary), like ``rkl``; at K = V it is ``rkl`` itself. It needs the
teacher's log-probs at the student's top-K, which moves as the student trains: the teacher scores
the full distribution (``LossSpec.teacher = "full"``), so a vLLM teacher (top-K prompt log-probs of
its own top-K) and stored (offline) rollouts cannot feed it.

``topk_diagnostics``: verl's ``forward_kl_topk`` metrics (``verl/trainer/distillation/fsdp/losses.py``
and ``verl/trainer/distillation/losses.py``), each a mean over the masked-in positions, with T the
teacher's top-K ids and S_K the student's top-K:

- ``teacher_mass`` = sum_{i in T} p_T(i): the teacher's own mass on its top-K;
- ``student_mass`` = sum_{i in T} p_S(i): the student's mass on the teacher's top-K;
- ``overlap_ratio`` = |T ∩ S_K| / K.

(verl computes them from its raw logits before any clamp; here p_S is the policy the loss
differentiates, ``opdkit.loss_table``, which is the raw softmax at temperature 1 and top-p 1.)
"""

from __future__ import annotations

import torch

from opdkit.token_losses import _at_least_fp32, _check_n_tokens, _floats, _mean, masked_sum

Tensor = torch.Tensor
NEG_INF = float("-inf")


def topk_diagnostics(student_logp_B_T_V: Tensor, teacher_ids_B_T_K: Tensor, teacher_logp_B_T_K: Tensor,
                     mask_B_T: Tensor) -> dict[str, Tensor]:
    """verl's ``teacher_mass``, ``student_mass`` and ``overlap_ratio`` (module docstring) as 0-dim
    detached tensors. ``student_logp_B_T_V``: the student policy's normalised log-probs;
    ``teacher_ids_B_T_K``: the teacher's K top ids (distinct); ``teacher_logp_B_T_K``: its normalised
    (full-vocabulary) log-probs of those ids; ``mask_B_T``: 1 = completion token."""
    B, T, _ = student_logp_B_T_V.shape
    K = teacher_ids_B_T_K.shape[-1]
    assert teacher_ids_B_T_K.shape == (B, T, K) and teacher_logp_B_T_K.shape == (B, T, K), \
        f"teacher top-K {tuple(teacher_ids_B_T_K.shape)} / {tuple(teacher_logp_B_T_K.shape)}, want {(B, T)} x K"
    mask_B_T = mask_B_T != 0
    with torch.no_grad():
        s_B_T_V = student_logp_B_T_V.detach().float()
        ids_B_T_K = teacher_ids_B_T_K.long()
        student_ids_B_T_K = s_B_T_V.topk(K, -1).indices  # S_K: the student's top-K (verl: topk of its logits)
        # |T ∩ S_K| per position: each teacher id compared with every student id, (B, T, K, K)
        overlap_B_T = (ids_B_T_K[..., :, None] == student_ids_B_T_K[..., None, :]).any(-1).float().sum(-1)
        return {
            "teacher_mass": _mean(teacher_logp_B_T_K.detach().float().exp().sum(-1), mask_B_T),
            "student_mass": _mean(s_B_T_V.gather(-1, ids_B_T_K).exp().sum(-1), mask_B_T),
            "overlap_ratio": _mean(overlap_B_T / K, mask_B_T),
        }


def _renormalised(logp_B_T_K: Tensor, in_S_B_T_K: Tensor) -> Tensor:
    """Log-probs renormalised over the ids of S (-inf outside it)."""
    x_B_T_K = logp_B_T_K.masked_fill(~in_S_B_T_K, NEG_INF)
    return x_B_T_K - torch.logsumexp(x_B_T_K, -1, keepdim=True)


def topk_rkl_loss(student_logits_B_T_V, teacher_logp_B_T_V, mask_B_T, n_tokens, *, k=16, teacher_temperature=1.0):
    """Reverse KL over the student's top-K ids, both distributions renormalised there (module
    docstring), token-mean over the step.

    Computed in fp32 (fp64 inputs stay fp64). Gradient: ∇KL(p̃_S || p̃_T) over S = the student's top-K, S
    held fixed (per logit: p̃_S(j) (log(p̃_S(j) / p̃_T(j)) - L_t) on S, 0 off S). At k >= the student's
    support it is the full reverse KL(p_S || p_T) (``rkl_loss``).

    ``student_logits_B_T_V``: the student policy's logits (with grad; -inf outside its top-p
    nucleus); ``teacher_logp_B_T_V``: the teacher's log-probs over the vocabulary (constants);
    ``k``: K (``loss.topk``; min(k, V) is used); ``teacher_temperature``: the teacher at
    softmax(z_T / t), as in ``losses.fkl_loss``.
    Metrics: ``rkl_topk`` (the loss's divergence), ``kl`` (the exact reverse KL(p_S || p_T) over the
    vocabulary), ``student_support_mass`` (p_S(S)) and ``teacher_support_mass`` (p_T(S)): what the
    renormalisation sets aside; ``teacher_mass``, ``student_mass``, ``overlap_ratio`` (verl's, over
    the teacher's top-K: ``topk_diagnostics``); ``tokens``.
    """
    shape = tuple(student_logits_B_T_V.shape)
    assert len(shape) == 3, f"student_logits_B_T_V must be B x T x V, got {shape}"
    B, T, V = shape
    assert tuple(teacher_logp_B_T_V.shape) == shape, \
        f"teacher_logp_B_T_V {tuple(teacher_logp_B_T_V.shape)}, want {shape}"
    assert mask_B_T.shape == (B, T), f"mask_B_T {tuple(mask_B_T.shape)} vs {(B, T)}"
    assert k >= 1, f"k must be >= 1 (params key loss.topk), got {k}"
    assert teacher_temperature > 0, f"teacher_temperature must be > 0, got {teacher_temperature}"
    mask_B_T = mask_B_T != 0
    n = _check_n_tokens(n_tokens)
    K = min(int(k), V)

    logits_B_T_V = _at_least_fp32(student_logits_B_T_V)  # fp32 (fp64 stays fp64)
    s_B_T_V = torch.log_softmax(logits_B_T_V, -1)
    t_B_T_V = teacher_logp_B_T_V.detach().to(s_B_T_V.dtype)
    if teacher_temperature != 1.0:
        t_B_T_V = torch.log_softmax(t_B_T_V / teacher_temperature, -1)
    t_B_T_V = torch.where(mask_B_T[..., None], t_B_T_V, s_B_T_V.detach())  # padding: garbage never reaches the loss

    ids_B_T_K = logits_B_T_V.detach().topk(K, -1).indices  # S: the student's top-K, a constant of the step
    z_B_T_K = logits_B_T_V.gather(-1, ids_B_T_K)  # from the logits: no path to the ids outside S
    in_S_B_T_K = z_B_T_K.detach() != NEG_INF  # p_S = 0 (outside the top-p nucleus): not in the support
    log_ps_B_T_K = _renormalised(z_B_T_K, in_S_B_T_K)
    log_pt_B_T_K = _renormalised(t_B_T_V.gather(-1, ids_B_T_K), in_S_B_T_K)
    ps_B_T_K = log_ps_B_T_K.exp()
    # the difference is zeroed outside S before the product (no 0 * inf in the value or the gradient)
    diff_B_T_K = torch.where(in_S_B_T_K, log_ps_B_T_K - log_pt_B_T_K, torch.zeros_like(log_ps_B_T_K))
    div_B_T = (ps_B_T_K * diff_B_T_K).sum(-1)
    loss = masked_sum(div_B_T, mask_B_T) / n

    with torch.no_grad():
        s_d_B_T_V = s_B_T_V.detach()
        p_s_B_T_V = s_d_B_T_V.exp()
        rkl_B_T = (p_s_B_T_V * torch.where(p_s_B_T_V > 0, s_d_B_T_V - t_B_T_V, torch.zeros_like(s_d_B_T_V))).sum(-1)
        t_top_B_T_K = t_B_T_V.topk(K, -1)  # the teacher's top-K, for verl's diagnostics
        metrics = {
            "rkl_topk": _mean(div_B_T, mask_B_T),
            "kl": _mean(rkl_B_T, mask_B_T),
            "student_support_mass": _mean(torch.where(in_S_B_T_K, s_d_B_T_V.gather(-1, ids_B_T_K).exp(), 0.0).sum(-1),
                                          mask_B_T),
            "teacher_support_mass": _mean(torch.where(in_S_B_T_K, t_B_T_V.gather(-1, ids_B_T_K).exp(), 0.0).sum(-1),
                                          mask_B_T),
            **topk_diagnostics(s_d_B_T_V, t_top_B_T_K.indices, t_top_B_T_K.values, mask_B_T),
            "tokens": mask_B_T.sum().float(),
        }
    return loss, _floats(metrics)
