"""Cross-tokenizer OPD losses over the spans of ``opdkit.xtok``: the teacher's scores moved to the
student's tokens, the span advantage, and the vocabulary projection of the full-distribution losses.

Notation: span j of a row holds student tokens i (log-probs s_i under p_S) and teacher tokens k
(log-probs t_k under p_T). S_j = sum_i s_i and T_j = sum_k t_k are the two models' log-probs of the
span's text given the same text before it (chain rule within the span).

- **Sampled-token losses (k1, k2, k3).** Each student token i of span j gets the span-equivalent
  teacher log-prob t~_i = T_j - (S_j - s_i) (the student's log-prob of the span's other tokens
  detached, ``with_student_rest``), and the loss function runs unchanged on (s_i, t~_i): so t~_i -
  s_i = T_j - S_j, the *span advantage*, for every token of the span (k1), and k2 / k3's gradients
  are (S_j - T_j) grad s_i and (1 - e^{T_j - S_j}) grad s_i. A span closes only where the teacher's
  tokenization cannot change with what follows (``xtok.Pair.closes``), so S_j and T_j never depend on
  later tokens, and summed over a span's tokens these are the per-token estimators applied to the
  span as one token: k1 / k2 follow grad KL(p_S || p_T) and
  k3 grad KL(p_T || p_S) over span-level outcomes (each span its own log-ratio, no future spans, as
  the per-token losses use each token's own). Giving every token the full span advantage, rather
  than spreading it (A_j / m over m tokens), is what makes this the score-function gradient of the
  span's log-ratio: grad log p_S(span) = sum_i grad s_i. A one-to-one span has t~_i = T_j = t_k
  exactly, so with one tokenizer on both sides these are the kit's losses, bit for bit.
- **Full-distribution losses (rkl, fkl).** At a one-to-one span both models predict the next piece
  of text after the same prefix; the teacher's distribution over its ids is projected onto the
  student's (``Projection``): every teacher id maps to one student id or to nothing, the buckets
  are the student ids that receive teacher mass plus one tail bucket, the teacher's bucket
  probability is the sum of its ids' (its unmapped ids in the tail), the student's is its id's
  (its ids that receive no teacher id in the tail). rkl / fkl run over these buckets
  (``losses.rkl_loss`` / ``fkl_loss``). Tokens of merged spans have no common next-token
  distribution: they train on the span's sampled estimator of the same divergence (rkl: span k2,
  fkl: span k3, on-policy, weight 1 like the full terms). With one tokenizer the map is the
  identity and no projection is made.
- **Metrics.** ``kl`` is the per-student-token reverse KL estimate: sum over spans of S_j - T_j
  (plus the exact bucket KL at one-to-one positions for rkl / fkl) over the student's tokens;
  ``xtok_one_to_one_frac``; with the full losses ``xtok_teacher_tail_mass`` /
  ``xtok_student_tail_mass`` (mean bucket-tail mass over the one-to-one positions).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from opdkit import loss_table, losses
from opdkit.scores import TeacherScores
from opdkit.scoring import token_logprobs
from opdkit.xtok import Pair, XtokBatch, span_sum

VOCAB_MAPS = ("prefix", "exact")  # teacher.vocab_map
LOG_TINY = math.log(torch.finfo(torch.float32).tiny)


def check_params(cfg) -> str | None:
    """Why these params cannot run across tokenizers (None: they can, or teacher.tokenizer=shared)."""
    T, L = cfg.teacher, cfg.loss
    if T.tokenizer != "own":
        return None
    if T.source not in ("model", "vllm"):
        return (f"teacher.tokenizer=own is for a teacher model with a tokenizer of its own; teacher.source={T.source} "
                "is the student itself: set teacher.tokenizer=shared")
    if cfg.teachers:
        return "teacher.tokenizer=own runs one teacher; with several teachers (params key 'teachers') keep it shared"
    if loss_table.xtok_support(L.name) is None:
        return (f"loss.name={L.name} has no cross-tokenizer form; with teacher.tokenizer=own use one of "
                f"{', '.join(loss_table.XTOK)} (opdkit train --help lists how each runs)")
    if L.teacher_temperature != 1.0:
        return ("loss.teacher_temperature tempers the teacher's next-token distribution, which merged spans do not "
                "have: leave it at 1 with teacher.tokenizer=own")
    if cfg.data.pad_side != "left":
        return f"data.pad_side={cfg.data.pad_side} replays a single-tokenizer layout; teacher.tokenizer=own needs left"
    return None


def active(ctx) -> bool:
    """Whether a teacher context is a cross-tokenizer one (``to_student``'s)."""
    return ctx is not None and ctx.cross_tokenizer


def to_student(ctx_t: TeacherScores | None, xb: XtokBatch, rows) -> TeacherScores | None:
    """A teacher context of the teacher's view (``step.teacher_context`` of ``xb.teacher``'s rows
    ``rows``: log-probs on the teacher's tokens) on the student's tokens of those rows:
    ``logp_B_T`` = T_j of each token's span (``with_student_rest`` then subtracts the rest of the
    span), the alignment tensors, and with the full losses the teacher's hidden state at a
    one-to-one span's teacher token (``hidden_B_T_H``, zeros elsewhere; masked out of the loss)."""
    if ctx_t is None:
        return None
    s_span_B_T, t_span_B_U = xb.s_span_B_T[rows], xb.t_span_B_U[rows]
    n = int(xb.n_spans_B[rows].max()) if s_span_B_T.numel() else 1
    T_B_J = span_sum(ctx_t.logp_B_T.float(), t_span_B_U, n)
    t_B_T = torch.where(s_span_B_T >= 0, T_B_J.gather(1, s_span_B_T.clamp_min(0)), torch.zeros_like(s_span_B_T,
                                                                                                   dtype=T_B_J.dtype))
    out = TeacherScores(t_B_T, xtok_span_logp_B_T=t_B_T, xtok_span_B_T=s_span_B_T, xtok_len_B_T=xb.s_len_B_T[rows],
                        xtok_one_B_T=xb.one_B_T[rows], xtok_respelled_B=xb.respelled_B[rows])
    if ctx_t.hidden_B_T_H is not None:
        h_B_U_H = ctx_t.hidden_B_T_H
        pos_B_T = xb.t_pos_B_T[rows]
        h_B_T_H = h_B_U_H.gather(1, pos_B_T[..., None].expand(-1, -1, h_B_U_H.shape[-1]))
        out.hidden_B_T_H = torch.where(xb.one_B_T[rows][..., None], h_B_T_H, torch.zeros_like(h_B_T_H))
        out.head = ctx_t.head
    return out


def with_student_rest(ctx: TeacherScores | None, head, h_B_T_H, ids_B_T, chunk: int, temperature: float, top_p: float):
    """``ctx`` with ``logp_B_T`` = t~_i = T_j - (S_j - s_i) (module docstring): the student's
    log-probs of the sampled tokens (detached, as the loss computes them) summed over each merged
    span, less the token's own. A token outside the student's top-p nucleus (s = -inf, left out of
    the loss) counts 0 in its span's sum. Unchanged where every span is one-to-one."""
    if not active(ctx) or not bool((ctx.xtok_len_B_T > 1).any()):
        return ctx
    with torch.no_grad():
        s_B_T = token_logprobs(head, h_B_T_H.detach(), ids_B_T, chunk, temperature, top_p)
        span_B_T = ctx.xtok_span_B_T
        s_B_T = torch.where(torch.isfinite(s_B_T) & (span_B_T >= 0), s_B_T, torch.zeros_like(s_B_T))
        S_B_J = span_sum(s_B_T, span_B_T, int(span_B_T.max()) + 1)
        rest_B_T = torch.where(ctx.xtok_len_B_T > 1, S_B_J.gather(1, span_B_T.clamp_min(0)) - s_B_T,
                               torch.zeros_like(s_B_T))
    return dataclasses.replace(ctx, logp_B_T=ctx.xtok_span_logp_B_T - rest_B_T)


# --- the vocabulary projection of the full-distribution losses ------------------------------------------------


@dataclass
class Projection:
    """Teacher ids -> buckets over the student's ids (module docstring)."""

    identity: bool  # one vocabulary: no projection
    image_K: torch.Tensor  # the student ids that receive teacher mass (sorted)
    bucket_W: torch.Tensor  # each teacher id's bucket: an index into image_K, or K (the tail)
    rest_R: torch.Tensor  # the student ids that receive none (the student's tail)
    tail_empty: bool  # no teacher id maps to the tail
    mapped_frac: float  # teacher ids mapped to a student id
    exact_frac: float  # teacher ids mapped to a student id with the same bytes

    def to(self, device) -> Projection:
        return Projection(self.identity, self.image_K.to(device), self.bucket_W.to(device), self.rest_R.to(device),
                          self.tail_empty, self.mapped_frac, self.exact_frac)


def vocab_map(pair: Pair, mode: str) -> tuple[list[int], int]:
    """Each teacher id's student id (-1: none) and how many mapped by identical bytes. ``exact``: the
    student id with the same bytes (GOLD's match, on bytes rather than token strings). ``prefix``:
    that, else the first student token of the teacher token's text (the student's tokenization of
    it; the teacher's special ids and text that is not UTF-8 excepted): the teacher's probability of a piece
    of text goes to the student token that starts it. The teacher's stop ids map to the student's
    EOS of the same bytes, else its first."""
    if mode not in VOCAB_MAPS:
        raise ValueError(f"teacher.vocab_map={mode!r}: expected one of {', '.join(VOCAB_MAPS)}")
    by_bytes: dict[bytes, int] = {}
    for i, b in enumerate(pair.s_bytes):
        if b:
            by_bytes.setdefault(b, i)
    out = [by_bytes.get(b, -1) if b else -1 for b in pair.t_bytes]
    exact = sum(i >= 0 for i in out)
    for t in {*pair.t_stop, pair.t_end}:
        same = [e for e in pair.s_eos if pair.s_bytes[e] == pair.t_bytes[t]]
        out[t] = same[0] if same else pair.s_eos[0]
    if mode == "prefix":
        todo, texts = [], []
        for t, (m, b) in enumerate(zip(out, pair.t_bytes)):
            if m < 0 and b and t not in pair.t_special:
                try:
                    texts.append(b.decode("utf-8"))
                    todo.append(t)
                except UnicodeDecodeError:
                    pass
        for t, ids in zip(todo, pair.s_encode(texts)):
            out[t] = ids[0] if ids and ids[0] != pair.s_unk else -1
    return out, exact


def make_projection(pair: Pair, mode: str, device=None) -> Projection:
    """The ``Projection`` of a pair's vocabulary map, on ``device`` (cached on the pair)."""
    key = ("projection", mode)
    if device is not None:
        if (key, str(device)) not in pair._cache:
            pair._cache[(key, str(device))] = make_projection(pair, mode).to(device)
        return pair._cache[(key, str(device))]
    if key not in pair._cache:
        m_W, exact = vocab_map(pair, mode)
        W, V = len(pair.t_bytes), len(pair.s_bytes)
        m = torch.tensor(m_W, dtype=torch.long)
        identity = W == V and torch.equal(m, torch.arange(W))
        image_K = torch.unique(m[m >= 0])
        bucket_of_V = torch.full((V,), len(image_K), dtype=torch.long)
        bucket_of_V[image_K] = torch.arange(len(image_K))
        bucket_W = torch.where(m >= 0, bucket_of_V[m.clamp_min(0)], len(image_K))
        rest_R = torch.nonzero(bucket_of_V == len(image_K))[:, 0]
        pair._cache[key] = Projection(identity, image_K, bucket_W, rest_R, bool((m >= 0).all()),
                                      float((m >= 0).float().mean()), exact / max(W, 1))
    return pair._cache[key]


def project(student_logits_B_C_V, teacher_logp_B_C_W, proj: Projection):
    """(student, teacher) log-probs over the K + 1 buckets, (B, C, K+1) each. The teacher's bucket
    sums run in probability space shifted by each position's max (a bucket whose mass underflows is
    floored at fp32 tiny times that max; an empty tail is -inf, as is the student's)."""
    s_logp_B_C_V = student_logits_B_C_V.float().log_softmax(-1)
    rest_B_C_R = s_logp_B_C_V.index_select(-1, proj.rest_R)
    none_B_C = (rest_B_C_R == float("-inf")).all(-1) if proj.rest_R.numel() else None
    if none_B_C is None:
        s_tail_B_C = torch.full(s_logp_B_C_V.shape[:2], float("-inf"), device=s_logp_B_C_V.device)
    else:  # no NaN gradient from a logsumexp over nothing but -inf
        safe_B_C_R = torch.where(none_B_C[..., None], torch.zeros_like(rest_B_C_R), rest_B_C_R)
        s_tail_B_C = torch.where(none_B_C, float("-inf"), torch.logsumexp(safe_B_C_R, -1))
    s_B_C_K1 = torch.cat([s_logp_B_C_V.index_select(-1, proj.image_K), s_tail_B_C[..., None]], -1)
    t_B_C_W = teacher_logp_B_C_W.detach().float()
    top_B_C = t_B_C_W.amax(-1, keepdim=True)
    K1 = proj.image_K.numel() + 1
    q_B_C_K1 = torch.zeros((*t_B_C_W.shape[:2], K1), device=t_B_C_W.device).index_add_(
        -1, proj.bucket_W, torch.exp(t_B_C_W - top_B_C))
    floor_B_C_K1 = (top_B_C + LOG_TINY).expand(-1, -1, K1)
    if proj.tail_empty:
        floor_B_C_K1 = floor_B_C_K1.clone()
        floor_B_C_K1[..., -1] = float("-inf")
    t_B_C_K1 = torch.where(q_B_C_K1 > 0, q_B_C_K1.log() + top_B_C, floor_B_C_K1)
    return s_B_C_K1, t_B_C_K1


def full_loss(name: str, student_logits_B_C_V, teacher_logp_B_C_W, logp_B_C, xtok_teacher_B_C, one_B_C, len_B_C,
              mask_B_C, n_tokens: float, proj: Projection, **params):
    """rkl / fkl across tokenizers (module docstring): the divergence over the projected buckets at
    one-to-one positions plus the span estimator (rkl: k2, fkl: k3) on merged spans' tokens.
    ``xtok_teacher_B_C``: t~ of each token (``with_student_rest``); ``len_B_C``: its span's student
    tokens. Returns (loss, metrics) as ``losses.rkl_loss`` does, ``kl`` per student token."""
    fn, est = {"rkl": (losses.rkl_loss, losses.k2_loss), "fkl": (losses.fkl_loss, losses.k3_loss)}[name]
    real_B_C = mask_B_C != 0
    one_mask_B_C, span_mask_B_C = (real_B_C & one_B_C).float(), (real_B_C & ~one_B_C).float()
    if proj.identity:
        s_in, t_in, tails = student_logits_B_C_V, teacher_logp_B_C_W, None
    else:
        s_in, t_in = project(student_logits_B_C_V, teacher_logp_B_C_W, proj)
        tails = (s_in[..., -1].detach().exp(), t_in[..., -1].exp())
    loss, m = fn(s_in, t_in, one_mask_B_C, n_tokens, **params)
    if not bool(span_mask_B_C.any()):
        return loss, m | _tail_metrics(tails, one_mask_B_C)
    loss_span, m_span = est(logp_B_C, logp_B_C.detach(), xtok_teacher_B_C, span_mask_B_C, n_tokens)
    n_one, n_span = m["tokens"], m_span["tokens"]
    out = m | _tail_metrics(tails, one_mask_B_C) | {"tokens": n_one + n_span}
    out["kl"] = (m["kl"] * n_one + _span_kl_sum(logp_B_C, xtok_teacher_B_C, len_B_C, span_mask_B_C)) / max(
        n_one + n_span, 1.0)
    return loss + loss_span, out


def _tail_metrics(tails, one_mask_B_C) -> dict:
    if tails is None:
        return {}
    n = float(one_mask_B_C.sum().clamp_min(1))
    return {"xtok_student_tail_mass": float((tails[0] * one_mask_B_C).sum()) / n,
            "xtok_teacher_tail_mass": float((tails[1] * one_mask_B_C).sum()) / n}


def _span_kl_sum(logp_B_C, xtok_teacher_B_C, len_B_C, mask_B_C) -> float:
    """sum over the masked tokens of (s - t~) / span length = sum over their spans of S_j - T_j."""
    with torch.no_grad():
        s_B_C = logp_B_C.detach().float()
        keep_B_C = (mask_B_C != 0) & torch.isfinite(s_B_C)
        d_B_C = (s_B_C - xtok_teacher_B_C.float()) / len_B_C.clamp_min(1)
        return float(torch.where(keep_B_C, d_B_C, torch.zeros_like(d_B_C)).sum())


def chunk_metrics(m: dict, ctx: TeacherScores, sl, logp_B_C, mask_B_C, sampled: bool) -> dict:
    """A cross-tokenizer chunk's metrics: ``xtok_one_to_one_frac`` and ``xtok_respelled_frac``
    (shares of its tokens); for a sampled-token loss with merged spans, ``kl`` per student token
    (sum over spans of S_j - T_j, each span counted once)."""
    real_B_C = mask_B_C != 0
    n = float(real_B_C.sum().clamp_min(1))
    one_B_C, len_B_C = ctx.xtok_one_B_T[:, sl], ctx.xtok_len_B_T[:, sl]
    out = dict(m)
    out["xtok_one_to_one_frac"] = float((one_B_C & real_B_C).sum()) / n
    out["xtok_respelled_frac"] = float((ctx.xtok_respelled_B[:, None] & real_B_C).sum()) / n
    if sampled and bool(((len_B_C > 1) & real_B_C).any()):
        keep_B_C = real_B_C & torch.isfinite(logp_B_C.detach())
        n_kept = float(keep_B_C.sum().clamp_min(1))
        out["kl"] = _span_kl_sum(logp_B_C, ctx.logp_B_T[:, sl], len_B_C, keep_B_C) / n_kept
    return out
