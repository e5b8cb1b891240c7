"""OPD plus a verifiable reward (opdkit.rewards): the group advantages against numpy, the reward
term's expected gradient against the gradient of the expected reward by exact enumeration over
every joint draw of a group's samples, lambda = 0 and tied groups as today's update, and a grader
failure as an error."""

import itertools
import json

import numpy as np
import pytest
import torch

from opdkit import grading, losses, rewards
from opdkit.config import Config, replace
from opdkit.data import Example
from opdkit.train import train

TINY = ("rollout.prompts_per_step=4", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=40",
        "budget.max_steps=2", "budget.max_wall_time_s=0", "optim.schedule=constant", "publish.every_steps=0",
        "optim.warmup_steps=0", "runtime.threads=1")


@pytest.mark.parametrize("baseline", ["mean", "loo"])
@pytest.mark.parametrize("norm", ["none", "std"])
def test_group_advantages_match_numpy(baseline, norm):
    r = np.array([[1, 0, 0, 1], [1, 1, 1, 1], [0, 0, 1, 0]], dtype=float)
    G = r.shape[1]
    expect = r - r.mean(1, keepdims=True) if baseline == "mean" else np.stack(
        [r[:, g] - np.delete(r, g, axis=1).mean(1) for g in range(G)], axis=1)
    if norm == "std":
        expect = expect / (r.std(1, ddof=1, keepdims=True) + 1e-6)
    got = rewards.group_advantages(torch.tensor(r), baseline, norm)
    assert np.allclose(got.numpy(), expect, atol=1e-6)
    assert got[1].abs().max() == 0  # a group whose samples all scored alike carries no reward signal


# --- the expected gradient, by exact enumeration --------------------------------------------------

V, T, G = 3, 2, 3  # a tiny autoregressive policy: 3 ids, completions of 2 tokens, groups of 3 samples
COMPLETIONS = list(itertools.product(range(V), repeat=T))  # the 9 completions


def planted_reward(y) -> float:
    return 1.0 if y[1] == 2 or y == (0, 0) else 0.0


def policy():
    torch.manual_seed(0)
    first_V = torch.randn(V, dtype=torch.float64, requires_grad=True)  # logits of the first token
    second_V_V = torch.randn(V, V, dtype=torch.float64, requires_grad=True)  # of the second, given the first
    return first_V, second_V_V


def token_logp(params, y) -> torch.Tensor:
    """(T,) log p of completion y's tokens under the policy (with grad)."""
    first_V, second_V_V = params
    return torch.stack([first_V.log_softmax(-1)[y[0]], second_V_V[y[0]].log_softmax(-1)[y[1]]])


def expected_reward_grad(params) -> torch.Tensor:
    """∇ E_{y ~ p}[r(y)], E[r] summed exactly over the 9 completions: the independent reference."""
    e = sum(token_logp(params, y).sum().exp() * planted_reward(y) for y in COMPLETIONS)
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(e, params)])


def expected_term_grad(params, term, n_tokens) -> torch.Tensor:
    """E over every joint draw of the G samples (9^3 = 729, each weighted by its probability) of the
    gradient of ``term(logp_G_T, old_G_T, adv_G_T, mask_G_T, n_tokens)``."""
    total = 0.0
    for draw in itertools.product(COMPLETIONS, repeat=G):
        logp_G_T = torch.stack([token_logp(params, y) for y in draw])
        prob = logp_G_T.detach().sum().exp()  # the draw's probability, a constant weight
        r_1_G = torch.tensor([[planted_reward(y) for y in draw]], dtype=torch.float64)
        total = total + prob * term(logp_G_T, logp_G_T.detach(), r_1_G, torch.ones(G, T), n_tokens)
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(total, params)])


LAMBDA = 0.7


def reward_term(baseline):
    def term(logp_G_T, old_G_T, r_1_G, mask_G_T, n):
        adv_G = rewards.group_advantages(r_1_G, baseline, "none")[0]
        loss, _ = losses.reward_pg_loss(logp_G_T, old_G_T, (LAMBDA * adv_G)[:, None].expand(G, T), mask_G_T, n,
                                        clip_eps=0.2, dual_clip=3.0)
        return loss
    return term


def k1_reward_part(baseline):
    """k1 with the reward in its advantage, minus k1 without: the reward's part of k1's update."""
    def term(logp_G_T, old_G_T, r_1_G, mask_G_T, n):
        adv_G = rewards.group_advantages(r_1_G, baseline, "none")[0]
        teacher_G_T = torch.full_like(logp_G_T, -1.1)  # any teacher: its part cancels
        with_r, _ = losses.k1_loss(logp_G_T, old_G_T, teacher_G_T, mask_G_T, n, 0.2, dual_clip=3.0,
                                   reward_adv_B_T=(LAMBDA * adv_G)[:, None].expand(G, T))
        without, _ = losses.k1_loss(logp_G_T, old_G_T, teacher_G_T, mask_G_T, n, 0.2, dual_clip=3.0)
        return with_r - without
    return term


@pytest.mark.parametrize("make_term", [reward_term, k1_reward_part], ids=["term", "k1_advantage"])
@pytest.mark.parametrize("baseline, factor", [("loo", 1.0), ("mean", (G - 1) / G)])
@pytest.mark.parametrize("per", ["sequence", "token"])
def test_expected_gradient_of_the_reward_is_lambda_grad_expected_reward(make_term, baseline, factor, per):
    """E[-∇L_r] = λ c (B / n) ∇E[r]: c = 1 with the leave-one-out baseline, (G-1)/G with the group
    mean; n = B (a per-sequence normaliser) gives λ c ∇E[r], n = the step's B T tokens λ c ∇E[r] / T."""
    params = policy()
    n = G if per == "sequence" else G * T
    got = -expected_term_grad(params, make_term(baseline), n)
    want = LAMBDA * factor * (G / n) * expected_reward_grad(params)
    assert want.abs().max() > 1e-2  # the planted reward really depends on the policy
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_the_group_mean_baseline_is_biased_by_g_minus_1_over_g():
    """The stated factor is not a tolerance: with the plain mean the gradient is short by 1/G."""
    params = policy()
    mean = -expected_term_grad(params, reward_term("mean"), G)
    loo = -expected_term_grad(params, reward_term("loo"), G)
    torch.testing.assert_close(mean, (G - 1) / G * loo, rtol=1e-9, atol=1e-12)
    assert (mean - loo).abs().max() > 1e-3


# --- lambda = 0, tied groups, and the run -----------------------------------------------------------


def _train(tmp_path, *overrides):
    res = train(replace(Config(), *TINY, *overrides), tmp_path, log=lambda *a: None, progress=False)
    rows = [json.loads(ln) for ln in (tmp_path / "metrics" / "train.jsonl").read_text().splitlines()]
    from safetensors.torch import load_file

    return res, rows, load_file(tmp_path / "checkpoints" / f"checkpoint-{res.step}" / "model.safetensors")


def test_reward_weight_zero_grades_nothing_and_logs_no_reward(tmp_path, monkeypatch):
    def no_grading(*a, **k):
        raise AssertionError("graded a completion with loss.reward_weight=0")

    monkeypatch.setattr(grading, "grade_answer", no_grading)
    _, rows, _ = _train(tmp_path, "loss.name=k1")
    assert not any(k.startswith("reward") for r in rows for k in r)


@pytest.mark.parametrize("loss", ["k1", "rkl"])
def test_a_step_whose_groups_all_tie_is_todays_update_bit_for_bit(tmp_path, monkeypatch, loss):
    """With lambda > 0 and every group's rewards alike (advantage 0) the reward machinery runs (grading,
    the term, its metrics) and changes nothing: the weights equal loss.reward_weight=0's, bit for bit."""
    _, _, plain = _train(tmp_path / "plain", f"loss.name={loss}")
    monkeypatch.setattr(rewards, "group_advantages", lambda r_P_G, b, n: torch.zeros_like(r_P_G, dtype=torch.float))
    _, rows, tied = _train(tmp_path / "tied", f"loss.name={loss}", "loss.reward_weight=1.0")
    assert all(0.0 <= r["reward_mean"] <= 1.0 and r["reward_share"] == 0.0 for r in rows)
    for k, v in plain.items():
        assert torch.equal(v, tied[k]), k


@pytest.mark.parametrize("loss", ["k1", "rkl", "topk_fkl"])
def test_the_reward_changes_the_update_and_is_logged(tmp_path, loss):
    _, rows, with_r = _train(tmp_path / "r", f"loss.name={loss}", "loss.reward_weight=2.0", "loss.reward_baseline=loo",
                             "rollout.samples_per_prompt=4")
    _, _, without = _train(tmp_path / "p", f"loss.name={loss}", "rollout.samples_per_prompt=4")
    for r in rows:
        assert 0.0 <= r["reward_mean"] <= 1.0 and 0.0 <= r["reward_tied_frac"] <= 1.0 and 0.0 <= r["reward_share"] < 1.0
    assert any(r["reward_share"] > 0 for r in rows)  # some group had mixed grades (the student is at ~40%)
    assert any(not torch.equal(v, without[k]) for k, v in with_r.items())


def test_reward_params_are_checked_before_anything_is_written(tmp_path):
    from opdkit.setup import RunError

    for bad, needle in ((("loss.name=sft",), "sft control"), (("rollout.samples_per_prompt=1",), "no baseline")):
        with pytest.raises(RunError, match=needle):
            train(replace(Config(), *TINY, "loss.reward_weight=0.5", *bad), tmp_path / "x", log=lambda *a: None)
        assert not (tmp_path / "x").exists()


# --- a grader failure -------------------------------------------------------------------------------


def _verify_raises(monkeypatch, gold):
    import math_verify

    real = math_verify.verify

    def verify(g, p, *a, **k):
        if any(str(x) == gold for x in g):
            raise RecursionError("planted grader failure")
        return real(g, p, *a, **k)

    monkeypatch.setattr(math_verify, "verify", verify)


def test_a_grader_failure_is_an_error_naming_the_row_not_a_zero_reward(monkeypatch):
    _verify_raises(monkeypatch, "13")
    rows = [Example("q7", "1+12?", "13", row=7), Example("q8", "1+1?", "2", row=8)]
    texts = ["so \\boxed{12}", "\\boxed{2}"]  # row 7's answer differs as a string: math-verify decides, and raises
    assert grading.grade_completion(texts[0], "13")["correct"] is False  # opdkit eval: "not equal"
    with pytest.raises(rewards.RewardError, match=r"data\.parquet, row 7 \(id q7\), completion 0.*'13'.*'12'"):
        rewards.grade_rewards(texts, rows, "data file data.parquet")
    assert rewards.grade_rewards(texts[1:], rows[1:]) == [1.0]  # the other row grades


def test_a_grader_failure_stops_the_run_and_publishes_nothing(tmp_path, monkeypatch):
    import math_verify

    def verify(*a, **k):
        raise RecursionError("planted grader failure")

    monkeypatch.setattr(math_verify, "verify", verify)
    with pytest.raises(rewards.RewardError, match="the grader failed on data file .*train"):
        train(replace(Config(), *TINY, "loss.reward_weight=0.5", "rollout.samples_per_prompt=4"), tmp_path,
              log=lambda *a: None, progress=False)
    assert json.loads((tmp_path / "run.json").read_text())["status"] == "failed"
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())
