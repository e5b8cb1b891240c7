"""OPD plus a verifiable reward: each completion's 0/1 grade against its row's answer, centred by
its prompt's group of G samples, as an advantage beside the teacher's signal (``loss.reward_*``).

``loss.reward_weight`` = λ (0, the default: nothing here runs, no completion is graded, and the
update is the plain OPD one bit for bit). Otherwise every completion of the step is decoded as
``opdkit eval`` decodes it and graded by ``grading.grade_completion`` against its row's answer:
r = 1 if its last ``\\boxed{}`` (or ``Answer:`` line) is equivalent to the answer, else 0. A grader
that raises instead of giving a verdict stops the step with ``RewardError`` naming the data file,
the row, the sample and the answer: a failure is never a zero reward (``opdkit eval`` counts it as
"not equal"; the reward does not).

Advantages (``group_advantages``), per prompt p over its G samples (GRPO's group baseline):

- ``loss.reward_baseline: mean``: A_g = r_g - mean_j r_j (GRPO, verl's ``grpo``);
- ``loo``: A_g = r_g - mean_{j != g} r_j, the leave-one-out baseline (RLOO), = G/(G-1) times the above;
- ``loss.reward_norm: std``: A divided by the group's standard deviation (unbiased, as ``torch.std``
  and verl's GRPO) + 1e-6; ``none`` leaves it in reward units.

The loss (``loss_table.LossSpec.reward``): k1 adds λ A_b to the per-token advantage of every token of
completion b (log p_T - log p_S + λ A_b, through its PPO surrogate); the other student-sampled losses
(k2, k3, topk_fkl, fkl, rkl, jsd) get a reward-weighted policy-gradient term beside them,
``token_losses.reward_pg_loss``, the same surrogate with the advantage λ A_b alone. The reward term
is a token sum over the step divided by the step's token count n, like every loss, so on-policy its
expected gradient is

    E[∇(-L_r)] = (λ / n) E[sum_b A_b ∇log p_S(y_b)] = λ (P G / n) c ∇ mean_p E_{y ~ p_S(.|p)}[r(y)],

with c = 1 for the leave-one-out baseline (the baseline of sample g does not depend on y_g, so it
adds nothing in expectation) and c = (G-1)/G for the plain group mean (which includes r_g itself).
P G / n is one over the mean completion length: per token, λ ∇E[r] spread over the completion's tokens
(tests/test_rewards.py checks both identities by exact enumeration over every joint draw of the G
samples of a tiny policy). ``reward_norm: std`` rescales each group and has no such identity.

That identity holds for a fixed token count n. With completions that stop at EOS, n (the step's real
token count) varies with the samples and correlates with them: the expected gradient then differs
from λ c (P G / E[n]) ∇E[r] by ``biases.VARIABLE_COUNT_BIAS`` (measured for one prompt at G = 2, 3,
4; less as a step has more rows). Under ``rollout.overlap: 1`` the
term's per-token PPO ratio does not correct for the stale prefix nor for the sequence-level reward
(``biases.REWARD_OVERLAP_BIAS``): the combination is refused (``check_params``).

The sft control trains on teacher samples or reference solutions, not the student's, so a policy
gradient there would be off-policy: refused (``check_params``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from opdkit import biases, grading, loss_table
from opdkit.data import Example

if TYPE_CHECKING:
    from opdkit.config import LossConfig

STD_EPS = 1e-6  # reward_norm: std adds it to each group's standard deviation (verl's GRPO epsilon)


class RewardError(ValueError):
    """A completion the grader could not give a verdict on (the message names the row and sample)."""


def check_params(cfg) -> str | None:
    """Why these params cannot use a reward (None when they can, or when the reward is off)."""
    L, G = cfg.loss, cfg.rollout.samples_per_prompt
    if L.reward_weight == 0:
        return None
    if loss_table.spec(L.name).reward == "none" or loss_table.samples_from(L) != "student":
        return (f"loss.reward_weight={L.reward_weight:g} with loss.name={L.name}: the reward is a policy gradient "
                "on the student's own samples; the sft control trains on other samples (set loss.reward_weight=0)")
    if G < 2:
        return (f"loss.reward_weight={L.reward_weight:g} needs rollout.samples_per_prompt >= 2: the reward is "
                f"centred by the prompt's group of samples, and a group of {G} has no baseline")
    if cfg.rollout.overlap:
        return (f"loss.reward_weight={L.reward_weight:g} with rollout.overlap=1: the reward term's per-token PPO ratio "
                "corrects neither the stale prefix nor the sequence-level reward (its expected gradient is "
                f"{biases.pct(biases.REWARD_OVERLAP_BIAS[True, 0.15])} off at a logit shift of sd 0.15, "
                f"{biases.pct(biases.REWARD_OVERLAP_BIAS[True, 0.5])} at 0.5: docs/fidelity.md); set rollout.overlap=0")
    return None


def group_advantages(r_P_G: torch.Tensor, baseline: str, norm: str) -> torch.Tensor:
    """(P, G) rewards -> (P, G) advantages centred within each prompt's group (module docstring);
    float32 (float64 for a float64 input), computed in float64."""
    assert r_P_G.dim() == 2 and r_P_G.shape[1] >= 2, f"r_P_G must be P x G with G >= 2, got {tuple(r_P_G.shape)}"
    G = r_P_G.shape[1]
    r_P_G_in_f64 = r_P_G.dtype == torch.float64
    r_P_G = r_P_G.double()
    mean_P_1 = r_P_G.mean(dim=1, keepdim=True)
    if baseline == "mean":
        adv_P_G = r_P_G - mean_P_1
    elif baseline == "loo":
        adv_P_G = r_P_G - (r_P_G.sum(dim=1, keepdim=True) - r_P_G) / (G - 1)
    else:
        raise ValueError(f"baseline={baseline!r}: expected mean or loo (params key loss.reward_baseline)")
    if norm == "std":
        adv_P_G = adv_P_G / (r_P_G.std(dim=1, keepdim=True) + STD_EPS)
    elif norm != "none":
        raise ValueError(f"norm={norm!r}: expected none or std (params key loss.reward_norm)")
    return adv_P_G if r_P_G_in_f64 else adv_P_G.float()


def completion_text(tokenizer, ids: list[int]) -> str:
    """A completion as the grader reads it (``opdkit eval`` decodes the same way)."""
    return tokenizer.decode(ids, skip_special_tokens=True)


def grade_rewards(texts: list[str], examples: list[Example], where: str = "the training data") -> list[float]:
    """0/1 reward of each completion ``texts[b]`` against ``examples[b].answer`` (one example per
    completion); a grader exception is a ``RewardError`` naming ``where``, the row and the sample."""
    if len(texts) != len(examples):
        raise ValueError(f"grade_rewards: {len(texts)} completions but {len(examples)} examples")
    verdicts: dict[tuple, bool] = {}
    out = []
    for b, (text, ex) in enumerate(zip(texts, examples)):
        pred = grading.extract_answer(text)
        key = (pred, ex.answer)
        if key not in verdicts:
            try:
                verdicts[key] = grading.grade_answer(pred, ex.answer, strict=True)
            except grading.GradingError as e:
                row = f"row {ex.row}" if ex.row >= 0 else "a row"
                raise RewardError(f"reward: the grader failed on {where}, {row} (id {ex.id}), completion {b} of the "
                                  f"step: answer {ex.answer!r}, extracted {pred!r}: {e}. A failure is not a zero "
                                  "reward; check the row's answer (or set loss.reward_weight=0)") from None
        out.append(1.0 if verdicts[key] else 0.0)
    return out


def step_rewards(loss: LossConfig, tokenizer, rollout, examples: list[Example], where: str = "the training data", *,
                 samples_per_prompt: int):
    """The step's rewards and advantages: ``(adv_B, r_B)``, both (B,) float on the rollout's device,
    rows prompt-major (``examples``: one per prompt, G = ``samples_per_prompt`` rows each, the params'
    ``rollout.samples_per_prompt``). ``adv_B`` is the group-centred advantage A_b (not yet times λ),
    by ``loss.reward_baseline`` and ``loss.reward_norm``."""
    G = samples_per_prompt
    B = rollout.completion_ids_B_T.shape[0]
    assert B == len(examples) * G, f"{B} rows for {len(examples)} prompts x {G} samples"
    lengths = rollout.completion_mask_B_T.sum(dim=1).long().tolist()
    texts = [completion_text(tokenizer, rollout.completion_ids_B_T[b, :lengths[b]].tolist()) for b in range(B)]
    r_B = torch.tensor(grade_rewards(texts, [ex for ex in examples for _ in range(G)], where))
    # (P, G) -> (B,)
    adv_B = group_advantages(r_B.view(-1, G), loss.reward_baseline, loss.reward_norm).reshape(-1)
    device = rollout.completion_ids_B_T.device
    return adv_B.to(device), r_B.to(device)


def step_metrics(r_B: torch.Tensor, G: int) -> dict:
    """Sums for train.jsonl (summed over ranks, then ``finish_metrics``): rewards, samples, groups
    whose G rewards are all equal (advantage 0: no reward signal), groups."""
    r_P_G = r_B.view(-1, G)  # (B,) -> (P, G), prompt-major
    tied = (r_P_G == r_P_G[:, :1]).all(dim=1)
    return {"reward_sum": float(r_B.sum()), "samples": r_B.numel(), "tied": int(tied.sum()), "groups": r_P_G.shape[0]}


def attach(loss: LossConfig, batch, tokenizer, examples: list[Example], world, where: str = "the training data", *,
           samples_per_prompt: int) -> tuple | None:
    """The training loop's step: with ``loss.reward_weight`` set, grade the batch's completions
    (``samples_per_prompt`` = G rows per example), put their advantages on ``batch.reward_adv_B``
    (``step_rewards``) and return ``step_metrics``' sums over the ranks (``world.sum``), for
    ``finish_metrics``; None (nothing graded) at λ = 0."""
    if not loss.reward_weight:
        return None
    batch.reward_adv_B, r_B = step_rewards(loss, tokenizer, batch.rollout, examples, where,
                                           samples_per_prompt=samples_per_prompt)
    return world.sum(*step_metrics(r_B, samples_per_prompt).values())


def finish_metrics(sums: tuple | None, m: dict) -> dict:
    """The step's metrics ``m`` with train.jsonl's reward keys from ``attach``'s ``sums`` (None: ``m``
    as it is): ``reward_mean`` (mean 0/1 reward of the step's completions), ``reward_tied_frac``
    (share of prompts whose samples all scored alike), and ``reward_share``: mean |λ A| over the mean
    |λ A| + |log p_T - log p_S| per token, the reward's share of the per-token advantage (for k1
    exactly its advantage; for the other losses the k1 signal the teacher gives). The per-token
    means it is made of (``reward_adv_abs``, ``teacher_adv_abs``) are not kept."""
    if sums is None:
        return m
    reward_sum, samples, tied, groups = sums
    out = {k: v for k, v in m.items() if k not in ("reward_adv_abs", "teacher_adv_abs")}
    r, t = m.get("reward_adv_abs"), m.get("teacher_adv_abs")
    share = r / (r + t) if r is not None and t is not None and r + t > 0 else 0.0
    return out | {"reward_mean": reward_sum / max(1, samples), "reward_tied_frac": tied / max(1, groups),
                  "reward_share": share}
