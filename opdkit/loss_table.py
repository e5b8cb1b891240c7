"""The losses, declared once: what each needs from the teacher, how it is called, what it reports.

``LOSSES`` maps every ``loss.name`` to a ``LossSpec``. The training step (``opdkit.step``) reads
it to decide what the teacher scores (``teacher``), which tensors the loss function gets
(``inputs``, by the names below) and with which params (``params``); the config validation, the
run checks (``opdkit.setup``), the loop (``opdkit.train``) and the CLI help read it too. The loss
functions themselves are pure tensor functions in ``opdkit.losses``; each spec holds its function
(``LossSpec.fn``, imported on first use).

The policies (one convention, the same in every engine and in the update; ``opdkit train --help``
and the README say it too):

- p_S, the student policy every loss differentiates (``update_policy``): the one the rollout
  samples, softmax(z / τ) of the student's logits z over the tokenizer's ids at τ =
  ``rollout.temperature``, truncated to the top-p nucleus S of ``rollout.top_p`` and renormalised
  (``engines.sampling.policy_logits``; greedy, τ = 0: the model's own softmax). The engines record
  log p_S of each sampled token (``old_logp_B_T``), so the importance ratio p_S / p_sampler of
  k1/k2/k3 is that of the policy that really sampled. S is recomputed from the current logits
  in the update; ids outside it have p_S = 0 and get no gradient, and a sampled token that falls
  outside it (rounding at the nucleus' edge) has weight 0. The sft control is supervised NLL of
  the model itself (τ = 1, no top-p), whatever the rollout settings.
- p_T, the teacher: its own distribution, softmax of its logits at temperature 1 over the
  tokenizer's ids, untruncated: the target the divergences compare p_S with (fkl / rkl / jsd:
  at ``loss.teacher_temperature`` instead, for the released OPSD recipe, which tempers both sides).

With top-p < 1, p_S is 0 outside S, so a divergence with the teacher first (k3, fkl, topk_fkl;
KL(p_T || p_S) would be infinite) is taken over S: sum_{v in S} p_T(v) log(p_T(v) / p_S(v)), whose
gradient is p_T(S) ∇KL(p_T|S || p_S) (p_T|S: the teacher renormalised over S; S is locally constant).
At top-p = 1 (S = every id) that is the forward KL itself.

Input names (``LossSpec.inputs``), per micro-batch chunk of completion positions:

- ``logp_B_T``: log p_S of the sampled tokens (with grad)
- ``old_logp_B_T``: sampling-time log p_S of the same tokens (the importance-weight reference)
- ``teacher_logp_B_T``: teacher log-probs of the same tokens
- ``logits_B_T_V``: the student policy's logits (with grad): z / τ, -inf outside the nucleus
- ``teacher_logp_B_T_V``: teacher log-probs over the vocabulary
- ``topk_ids_B_T_K``, ``topk_logp_B_T_K``: the teacher's top-K ids and their log-probs
- ``mask_B_T``, ``n_tokens``: completion mask; masked-in tokens of the whole step

This module imports nothing heavy (the config validation reads it).
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

TEACHER_NEEDS = ("none", "recorded", "token", "topk", "full")  # what the teacher scores, cheapest first
_TOKEN = ("logp_B_T", "old_logp_B_T", "teacher_logp_B_T", "mask_B_T", "n_tokens")
_FULL = ("logits_B_T_V", "teacher_logp_B_T_V", "mask_B_T", "n_tokens")
_CLIP_METRICS = ("kl", "kl_forward", "clipped_mass", "clipped_frac", "topk_overlap", "tokens")
_TOPK_METRICS = ("teacher_mass", "student_mass", "overlap_ratio")  # verl's, every top-K loss (opdkit.topk_losses)


def _losses():
    """``opdkit.losses``, imported on first use: this module stays torch-free for the config and the CLI help."""
    from opdkit import losses

    return losses


@dataclass(frozen=True)
class LossSpec:
    name: str
    fn: Callable[[], Callable]  # the loss function (``lambda: _losses().k1_loss``: imported on first call)
    inputs: tuple[str, ...]  # its positional arguments (names above)
    teacher: str  # what the teacher scores: token (sampled-token log-probs) | topk | full | none
    params: Callable[[Any], dict]  # its keyword arguments, from the loss config (``LossConfig``)
    metrics: tuple[str, ...]  # the keys of the metrics it returns
    divergence: str  # the divergence whose gradient its expected gradient is
    summary: str  # one line for the CLI help
    # where loss.reward_weight's reward goes (opdkit.rewards): advantage (added to the per-token advantage;
    # the function takes ``reward_adv_B_T``) | term (a reward-weighted policy-gradient term beside it,
    # token_losses.reward_pg_loss) | none (refused: not the student's samples)
    reward: str = "term"

    @property
    def function(self) -> Callable:
        """The loss function itself: ``(*inputs, **params) -> (loss, metrics)``."""
        return self.fn()


def _clip_params(L) -> dict:
    return {"clip": L.clip, "tau": L.clip_tau if L.clip != "none" else math.inf,
            "teacher_temperature": L.teacher_temperature}


LOSSES: dict[str, LossSpec] = {s.name: s for s in (
    LossSpec("k1", lambda: _losses().k1_loss, _TOKEN, "token",
             lambda L: {"clip_eps": L.clip_eps, "dual_clip": L.dual_clip},
             ("kl", "advantage_mean", "ratio_clipped_frac", "dual_clipped_frac", "ratio_max", "tokens"),
             "KL(p_S || p_T)", "PPO policy gradient, per-token advantage log p_T - log p_S (loss.clip_eps, "
             "loss.dual_clip)", reward="advantage"),
    LossSpec("k2", lambda: _losses().k2_loss, _TOKEN, "token", lambda L: {}, ("kl", "k2", "ratio_max", "tokens"),
             "KL(p_S || p_T)", "1/2 (log p_S - log p_T)^2 of each sampled token, differentiated directly"),
    LossSpec("k3", lambda: _losses().k3_loss, _TOKEN, "token", lambda L: {}, ("kl", "k3", "ratio_max", "tokens"),
             "KL(p_T || p_S)", "r - 1 - log r (r = p_T / p_S) of each sampled token, differentiated directly"),
    LossSpec("topk_fkl", lambda: _losses().topk_fkl_loss,
             ("logits_B_T_V", "topk_ids_B_T_K", "topk_logp_B_T_K", "mask_B_T", "n_tokens"),
             "topk", lambda L: {"tail_bucket": L.tail_bucket},
             ("fkl_topk", "rkl_topk", "teacher_topk_mass", "student_topk_mass", "topk_overlap", *_TOPK_METRICS,
              "tokens"),
             "KL(p_T || p_S) over the teacher's top-K (+ tail bucket)",
             "forward KL over the teacher's top-K ids (loss.topk, loss.tail_bucket)"),
    LossSpec("topk_rkl", lambda: _losses().topk_rkl_loss, _FULL, "full",
             lambda L: {"k": L.topk, "teacher_temperature": L.teacher_temperature},
             ("rkl_topk", "kl", "student_support_mass", "teacher_support_mass", *_TOPK_METRICS, "tokens"),
             "KL(p_S|S || p_T|S), both renormalised over the student's top-K S (S held fixed)",
             "reverse KL over the student's top-K ids, both renormalised there (loss.topk)"),
    LossSpec("fkl", lambda: _losses().fkl_loss, _FULL, "full", _clip_params, _CLIP_METRICS, "KL(p_T || p_S)",
             "forward KL over the vocabulary (loss.clip, loss.clip_tau)"),
    LossSpec("rkl", lambda: _losses().rkl_loss, _FULL, "full", _clip_params, _CLIP_METRICS, "KL(p_S || p_T)",
             "reverse KL over the vocabulary (loss.clip, loss.clip_tau)"),
    LossSpec("jsd", lambda: _losses().jsd_loss, _FULL, "full", lambda L: {"beta": L.jsd_beta, **_clip_params(L)},
             _CLIP_METRICS + ("jsd",), "generalized JSD_beta(p_T, p_S)",
             "generalized JSD of GKD (loss.jsd_beta: 0 forward KL, 1 reverse KL)"),
    LossSpec("sft", lambda: _losses().sft_loss, ("logp_B_T", "mask_B_T", "n_tokens"), "token", lambda L: {},
             ("nll", "tokens"),
             "KL(p_data || p_S) (cross-entropy)", "control: supervised NLL of teacher samples or reference "
             "solutions (loss.sft_source)", reward="none"),
)}
LOSS_NAMES = tuple(LOSSES)


def spec(name: str) -> LossSpec:
    if name not in LOSSES:
        raise ValueError(f"loss.name={name!r}: expected one of {', '.join(LOSS_NAMES)}")
    return LOSSES[name]


OFFLINE_NEEDS = ("token", "topk")  # what a pool stores of the teacher once (opdkit.offline): a token's, or K values


def trains_offline(name: str) -> bool:
    """Whether loss ``name`` can train on an offline pool (``rollout.source=offline``): it trains on the
    student's samples (here: the pool policy's) and needs of the teacher what a pool stores once, each
    sampled token's log-prob or its top-K; a full-distribution loss needs the teacher at ids the current
    student puts mass on (``opdkit.offline`` refuses those, with the reason)."""
    s = spec(name)
    return s.teacher in OFFLINE_NEEDS and s.reward != "none"


def samples_from(L) -> str:
    """Who writes the completions the loss is computed on: student | teacher | reference."""
    return L.sft_source if L.name == "sft" else "student"


def update_policy(L, R) -> tuple[float, float]:
    """(temperature, top_p) of the student policy p_S that loss config ``L`` differentiates, for
    rollout config ``R``: the rollout's own (the policy it samples; module docstring), except for
    the sft control, which trains the model itself (1.0, 1.0)."""
    return (1.0, 1.0) if L.name == "sft" else (R.temperature, R.top_p)


def reads_sampling_logp(L, R) -> bool:
    """Whether loss config ``L`` (rollout config ``R``) reads the sampling-time log-probs: the loss's
    function (``old_logp_B_T``), the reward's policy-gradient term (``loss.reward_weight`` > 0 with
    ``reward="term"``: its importance ratio), or the sft control's ``kl`` from the recorded teacher
    log-probs (``teacher_need`` = ``recorded``). The engines need record them only then (and for the
    first batch's alignment check)."""
    s = spec(L.name)
    return ("old_logp_B_T" in s.inputs or (L.reward_weight != 0 and s.reward == "term")
            or teacher_need(L, R) == "recorded")


def teacher_need(L, R) -> str:
    """What the teacher scores for loss config ``L`` and rollout config ``R``: the loss's ``teacher``,
    except for the sft control: on references nothing (``none``); on teacher samples drawn at
    temperature 1 and top-p 1 (or greedily) nothing either (``recorded``): the engines record log π of
    each sampled token under the policy that sampled it (module docstring), here the teacher's own
    distribution, so its ``kl`` metric reads those instead of a second teacher pass. At other rollout
    settings the recorded value is the tempered or truncated policy's, not the teacher's: the teacher
    scores its samples (``token``)."""
    source = samples_from(L)
    if source == "reference":
        return "none"
    if source == "teacher" and (R.temperature <= 0 or (R.temperature == 1.0 and R.top_p >= 1.0)):
        return "recorded"
    return spec(L.name).teacher


CONVENTION = (
    "p_S is the policy the rollout samples: softmax(logits / rollout.temperature) over the tokenizer's ids, "
    "truncated to the rollout.top_p nucleus (greedy: temperature 1); the engines record log p_S of each sampled "
    "token and every loss differentiates log p_S computed the same way (sft: the model itself, temperature 1). p_T "
    "is the teacher's own distribution (temperature 1, no top-p). With top-p < 1 the teacher-first divergences "
    "(k3, fkl, topk_fkl) run over the student's nucleus.")


def help_text() -> str:
    """One line per loss: name, what it is, the divergence its expected gradient follows; then the convention."""
    lines = [f"  {s.name:9s}{s.summary}; gradient of {s.divergence}" for s in LOSSES.values()]
    offline = ", ".join(n for n in LOSS_NAMES if trains_offline(n))
    lines.append("  offline (-S rollout.source=offline -S rollout.offline_file=POOL, a pool from "
                 f"`opdkit offline-rollouts`; docs/offline_opd.md): {offline}")
    return "\n".join(lines) + "\n\n" + textwrap.fill(CONVENTION, 100, initial_indent="  ", subsequent_indent="  ")


# Cross-tokenizer OPD (teacher.tokenizer=own; opdkit.xtok aligns the two tokenizations into spans, opdkit.xtok_loss
# computes these): how each loss runs when the teacher has a tokenizer of its own. A loss not listed is refused.
XTOK: dict[str, str] = {
    "k1": "the span advantage T_j - S_j (teacher minus student log-prob of the span's text) on every token of the span",
    "k2": "k2 of the span's log-ratio S_j - T_j, its gradient on every token of the span",
    "k3": "k3 of the span's ratio exp(T_j - S_j), its gradient on every token of the span",
    "rkl": "reverse KL at one-to-one spans over the teacher's distribution projected onto the student's ids "
           "(teacher.vocab_map; unmapped mass in a tail bucket), span k2 on merged spans",
    "fkl": "forward KL at one-to-one spans over the teacher's distribution projected onto the student's ids "
           "(teacher.vocab_map; unmapped mass in a tail bucket), span k3 on merged spans",
}


def xtok_support(name: str) -> str | None:
    """How loss ``name`` runs across tokenizers (``XTOK``), None where it does not."""
    return XTOK.get(name)


def xtok_help_text() -> str:
    """The CLI help's cross-tokenizer section: one line per loss."""
    lines = [f"  {name:9s}{XTOK.get(name, 'not supported (teacher.tokenizer=shared only)')}" for name in LOSSES]
    return "cross-tokenizer (-S teacher.tokenizer=own: the teacher scores the text in its own tokens):\n" + "\n".join(
        textwrap.fill(line, 100, subsequent_indent=" " * 11) for line in lines)
