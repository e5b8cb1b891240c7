"""Tests for opdkit.stats against hand computations on small tables, scipy.stats and a
published textbook example."""

import math

import numpy as np
import pytest
from scipy import stats as scipy_stats

from opdkit.stats import (
    clustered_accuracy,
    compare_arms,
    detectable_effect,
    kl_bin_means,
    majority_vote,
    paired_question_diff,
    pass_at_k,
    repeat_stats,
    repeats_needed,
    summarize_runs,
    t_test_power,
)


def test_clustered_accuracy_equal_sizes():
    out = clustered_accuracy([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    # s = (0.5, 1, 0); sd(ddof=1) = sqrt(((0)^2 + 0.5^2 + 0.5^2) / 2) = 0.5; SE = 0.5 / sqrt(3)
    assert out["accuracy"] == pytest.approx(0.5)
    assert out["stderr"] == pytest.approx(0.28867513459481287)
    # naive: p = 6/12, sqrt(0.25 / 12)
    assert out["accuracy_pooled"] == pytest.approx(0.5)
    assert out["stderr_naive"] == pytest.approx(0.14433756729740643)
    assert (out["n_questions"], out["n_samples"], out["samples_per_question"]) == (3, 12, 4.0)


def test_clustered_accuracy_unequal_sizes_dict():
    out = clustered_accuracy({"a": [1, 0], "b": [1, 1, 1], "c": [0, 0, 0, 0, 1]})
    # s = (0.5, 1.0, 0.2): question-weighted mean 1.7/3; deviations (-1/15, 13/30, -11/30),
    # sum of squares 0.32667, var 0.163333, SE = sqrt(0.163333 / 3) = 0.233333
    assert out["accuracy"] == pytest.approx(1.7 / 3)
    assert out["stderr"] == pytest.approx(0.23333333333333334)
    # pooled: 5 correct of 10 samples (differs from the question-weighted accuracy)
    assert out["accuracy_pooled"] == pytest.approx(0.5)
    assert out["stderr_naive"] == pytest.approx(math.sqrt(0.25 / 10))
    assert (out["n_questions"], out["n_samples"]) == (3, 10)
    assert out["samples_per_question"] == pytest.approx(10 / 3)


def test_clustered_exceeds_naive_when_all_or_nothing():
    out = clustered_accuracy([[1] * 8, [0] * 8, [1] * 8, [0] * 8])
    # s = (1, 0, 1, 0): sd = sqrt(1/3), SE = sqrt(1/3) / 2; naive = sqrt(0.25 / 32)
    assert out["stderr"] == pytest.approx(0.28867513459481287)
    assert out["stderr_naive"] == pytest.approx(0.08838834764831845)
    assert out["stderr"] > 3 * out["stderr_naive"]


def test_clustered_matches_formula_in_docstring():
    rng = np.random.default_rng(0)
    table = [list(rng.integers(0, 2, size=int(rng.integers(1, 6)))) for _ in range(20)]
    s = np.array([np.mean(x) for x in table])
    C = len(s)
    expected = math.sqrt(((s - s.mean()) ** 2).sum() / (C * (C - 1)))
    assert clustered_accuracy(table)["stderr"] == pytest.approx(expected)


def test_clustered_accuracy_bad_input():
    with pytest.raises(ValueError, match="question 1"):
        clustered_accuracy([[1], []])
    with pytest.raises(ValueError, match="'q'.*\\[0, 1\\]"):
        clustered_accuracy({"q": [2]})
    with pytest.raises(ValueError, match="no questions"):
        clustered_accuracy([])
    assert math.isnan(clustered_accuracy([[1, 0]])["stderr"])


def test_repeat_stats():
    out = repeat_stats([0.5, 0.6, 0.7])
    assert out["mean"] == pytest.approx(0.6)
    assert out["sd"] == pytest.approx(0.1)
    assert out["se"] == pytest.approx(0.1 / math.sqrt(3))
    assert (out["n"], out["min"], out["max"]) == (3, 0.5, 0.7)
    assert math.isnan(repeat_stats([0.4])["sd"])


def test_compare_arms_by_hand():
    out = compare_arms([0.6, 0.7, 0.8], [0.5, 0.5, 0.6, 0.6])
    # arm: mean .7, sd .1, se^2 = .01/3; baseline: mean .55, sd^2 = .01/3, se^2 = .01/12
    assert out["diff"] == pytest.approx(0.15)
    assert out["se"] == pytest.approx(math.sqrt(0.01 / 3 + 0.01 / 12))  # 0.0645497
    assert out["diff_in_se"] == pytest.approx(2.3237900077244493)
    # Welch df = (1/240)^2 / ((1/300)^2 / 2 + (1/1200)^2 / 3) = 3 exactly
    assert out["df"] == pytest.approx(3.0)
    ref = scipy_stats.ttest_ind([0.6, 0.7, 0.8], [0.5, 0.5, 0.6, 0.6], equal_var=False)
    assert out["p_method"] == "t"
    assert out["p_value"] == pytest.approx(ref.pvalue, rel=1e-12)


# Student (1908), "The probable error of a mean", Biometrika 6(1): 1-25 -- Cushny & Peebles'
# extra hours of sleep of 10 patients under two soporifics, R's `datasets::sleep`. Its help page's
# examples publish: t.test(extra ~ group, data = sleep) (Welch): t = -1.8608, df = 17.776,
# p-value = 0.07939; with paired = TRUE: t = -4.0621, df = 9, p-value = 0.002833.
SLEEP_1 = [0.7, -1.6, -0.2, -1.2, -0.1, 3.4, 3.7, 0.8, 0.0, 2.0]
SLEEP_2 = [1.9, 0.8, 1.1, 0.1, -0.1, 4.4, 5.5, 1.6, 4.6, 3.4]


def test_compare_arms_on_students_sleep_data_welch():
    out = compare_arms(SLEEP_1, SLEEP_2)
    assert out["diff"] == pytest.approx(0.75 - 2.33)
    assert out["diff_in_se"] == pytest.approx(-1.8608, abs=5e-5)
    assert out["df"] == pytest.approx(17.776, abs=5e-4)
    assert out["p_value"] == pytest.approx(0.07939, abs=5e-6)


def test_paired_question_diff_on_students_sleep_data():
    """Scores must lie in [0, 1]: the hours are mapped by x -> (x + 2) / 8 (t is unchanged by one
    affine map applied to both arms), one question per patient."""
    a = [[(x + 2) / 8] for x in SLEEP_1]
    b = [[(x + 2) / 8] for x in SLEEP_2]
    out = paired_question_diff(a, b)
    assert out["diff_in_se"] == pytest.approx(-4.0621, abs=5e-5)
    assert out["p_value"] == pytest.approx(0.002833, abs=5e-7)
    assert out["diff"] * 8 == pytest.approx(0.75 - 2.33)


@pytest.mark.parametrize("seed", range(5))
def test_p_values_equal_scipys_t_tests(seed):
    """Random small samples (3-8 repeats, unequal sizes and spreads), against scipy.stats."""
    rng = np.random.default_rng(seed)
    n_a, n_b = rng.integers(3, 9, size=2)
    arm, base = rng.normal(0.6, 0.05, n_a), rng.normal(0.55, 0.02 * (seed + 1), n_b)
    out, ref = compare_arms(list(arm), list(base)), scipy_stats.ttest_ind(arm, base, equal_var=False)
    assert out["diff_in_se"] == pytest.approx(ref.statistic, rel=1e-10)
    assert out["df"] == pytest.approx(ref.df, rel=1e-10)
    assert out["p_value"] == pytest.approx(ref.pvalue, rel=1e-9)
    P = int(rng.integers(4, 30))
    a = [list(rng.integers(0, 2, size=int(rng.integers(1, 5)))) for _ in range(P)]
    b = [list(rng.integers(0, 2, size=int(rng.integers(1, 5)))) for _ in range(P)]
    s_a, s_b = np.array([np.mean(x) for x in a]), np.array([np.mean(x) for x in b])
    if np.all(s_a == s_b):
        return
    out, ref = paired_question_diff(a, b), scipy_stats.ttest_rel(s_a, s_b)
    assert out["diff_in_se"] == pytest.approx(ref.statistic, rel=1e-10)
    assert out["p_value"] == pytest.approx(ref.pvalue, rel=1e-9)


def test_three_seeds_use_the_t_distribution_not_the_normal():
    """The issue's case: with three seeds the normal approximation gave p = 0.020 where Welch's t
    gives 0.103 (df = 3)."""
    out = compare_arms([0.6, 0.7, 0.8], [0.5, 0.5, 0.6, 0.6])
    assert out["p_value"] == pytest.approx(0.1027, abs=1e-4)
    assert out["p_value"] > 4 * math.erfc(abs(out["diff_in_se"]) / math.sqrt(2))


def test_compare_arms_needs_two_repeats():
    with pytest.raises(ValueError, match=">= 2 repeats"):
        compare_arms([0.5], [0.4, 0.6])


def test_paired_question_diff():
    a = [[1, 1], [1, 0], [0, 0]]
    b = [[1, 0], [1, 0], [0, 0]]
    out = paired_question_diff(a, b)
    # d = (0.5, 0, 0): mean 1/6, sd = sqrt(1/12), se = sqrt(1/12)/sqrt(3) = 1/6 -> t = 1
    assert out["diff"] == pytest.approx(1 / 6)
    assert out["se"] == pytest.approx(1 / 6)
    assert out["diff_in_se"] == pytest.approx(1.0)
    assert out["n_questions"] == 3
    assert out["p_method"] == "t"  # t = 1 with df = 2: p = 1 - 1/sqrt(3)
    assert out["p_value"] == pytest.approx(1 - 1 / math.sqrt(3))
    # equal to the difference of clustered accuracies
    assert out["diff"] == pytest.approx(clustered_accuracy(a)["accuracy"]
                                        - clustered_accuracy(b)["accuracy"])
    # dicts are aligned by question id, whatever their order
    da = {"x": a[0], "y": a[1], "z": a[2]}
    db = {"z": b[2], "x": b[0], "y": b[1]}
    assert paired_question_diff(da, db) == out


def test_paired_beats_unpaired_when_difficulty_is_shared():
    a = [[1, 1], [1, 1], [0, 0], [0, 1]]
    b = [[1, 1], [1, 0], [0, 0], [0, 0]]
    out = paired_question_diff(a, b)
    assert out["se"] < out["se_unpaired"]


def test_paired_question_diff_mismatch():
    with pytest.raises(ValueError, match="only in a"):
        paired_question_diff({"x": [1]}, {"y": [1]})
    with pytest.raises(ValueError, match="2 questions in a, 1 in b"):
        paired_question_diff([[1], [0]], [[1]])


def test_kl_bin_means():
    out = kl_bin_means([1, 2, 3, 4, 5, 9], [0, 0.5, 1, 1.5, 4, 7], [0, 1, 2, 3, 4])
    assert [b["count"] for b in out] == [2, 2, 0, 1]  # key 4 is in the closed last bin; 7 dropped
    assert [b["mean"] for b in out[:2]] == [1.5, 3.5]
    assert math.isnan(out[2]["mean"])
    assert out[3]["mean"] == 5.0
    assert (out[0]["lo"], out[0]["hi"]) == (0.0, 1.0)


def test_kl_bin_means_2d_and_nan_padding():
    kl_B_T = np.array([[1.0, 2.0, np.nan], [3.0, 4.0, 5.0]])
    pos_B_T = np.array([[0, 1, 2], [0, 1, 2]])
    out = kl_bin_means(kl_B_T, pos_B_T, [0, 1, 2, 3])
    assert [b["mean"] for b in out] == [2.0, 3.0, 5.0]
    assert [b["count"] for b in out] == [2, 2, 1]
    with pytest.raises(ValueError, match="strictly increasing"):
        kl_bin_means([1], [1], [1, 1])


def test_summarize_runs():
    records = [
        {"arm": "opd", "seed": 0, "accuracy": 0.5, "stderr": 0.02},
        {"arm": "sft", "seed": 0, "accuracy": 0.4, "stderr": 0.03},
        {"arm": "opd", "seed": 1, "accuracy": 0.6, "stderr": 0.02},
        {"arm": "opd", "seed": 2, "accuracy": 0.7, "stderr": 0.05},
    ]
    out = summarize_runs(records)
    assert list(out) == ["opd", "sft"]
    assert out["opd"]["mean"] == pytest.approx(0.6)
    assert out["opd"]["sd"] == pytest.approx(0.1)
    assert out["opd"]["se"] == pytest.approx(0.1 / math.sqrt(3))
    assert out["opd"]["seeds"] == [0, 1, 2]
    assert out["opd"]["mean_stderr"] == pytest.approx(0.03)
    assert out["sft"]["n"] == 1 and math.isnan(out["sft"]["sd"])
    with pytest.raises(ValueError, match="record 0 lacks keys \\['stderr'\\]"):
        summarize_runs([{"arm": "a", "seed": 0, "accuracy": 0.5}])
    with pytest.raises(ValueError, match="repeats arm='opd' seed=0"):
        summarize_runs(records + [records[0]])


# Repeats per arm for 80% power at a two-sided 0.05, by Cohen's d (effect / sd): Cohen (1988), Table 2.4.1, and
# G*Power; the same from statsmodels 0.15.0 (TTestIndPower / TTestPower .solve_power, rounded up): unpaired 393.4,
# 63.8, 36.3, 25.5, 16.7; paired (one-sample on the differences) 198.2, 33.4, 19.7, 14.3, 9.9.
REPEATS_80 = {0.2: (394, 199), 0.5: (64, 34), 2 / 3: (37, 20), 0.8: (26, 15), 1.0: (17, 10)}
# the smallest d found with 80% power at n per arm (statsmodels 0.15.0 solve_power(nobs1=n) / (nobs=n))
DETECTABLE_80 = {3: (3.070892, 3.264044), 4: (2.380754, 2.127949), 5: (2.024440, 1.681997), 8: (1.506634, 1.156035)}


@pytest.mark.parametrize("d", sorted(REPEATS_80))
def test_repeats_needed_matches_the_power_tables(d):
    unpaired, paired = REPEATS_80[d]
    for sd in (1.0, 1.5, 0.01):  # only d = effect / sd matters
        assert repeats_needed(d * sd, sd) == unpaired
        assert repeats_needed(d * sd, sd, paired=True) == paired
    # the count is the first that reaches the power: one fewer falls short
    assert t_test_power(d, 1.0, unpaired) >= 0.8 > t_test_power(d, 1.0, unpaired - 1)


@pytest.mark.parametrize("n", sorted(DETECTABLE_80))
def test_detectable_effect_matches_statsmodels_and_inverts_the_power(n):
    unpaired, paired = DETECTABLE_80[n]
    assert detectable_effect(1.0, n) == pytest.approx(unpaired, abs=2e-6)
    assert detectable_effect(1.0, n, paired=True) == pytest.approx(paired, abs=2e-6)
    assert detectable_effect(1.5, n) == pytest.approx(1.5 * unpaired, abs=3e-6)
    assert t_test_power(detectable_effect(1.0, n), 1.0, n) == pytest.approx(0.8, abs=1e-8)


def test_t_test_power_is_the_rejection_rate_of_scipys_t_tests():
    """Monte Carlo: normal repeats with a true difference, tested by scipy.stats.ttest_ind / ttest_1samp; the share
    rejected at 0.05 against t_test_power (20,000 experiments: binomial sd of the share <= 0.0036)."""
    rng = np.random.default_rng(0)
    reps, n, sd, effect = 20_000, 5, 1.5, 2.5
    a = rng.normal(effect, sd, (reps, n))
    b = rng.normal(0.0, sd, (reps, n))
    rate = float((scipy_stats.ttest_ind(a, b, axis=1).pvalue < 0.05).mean())
    assert rate == pytest.approx(t_test_power(effect, sd, n), abs=0.015)
    diffs = rng.normal(1.0, sd, (reps, n))
    rate = float((scipy_stats.ttest_1samp(diffs, 0.0, axis=1).pvalue < 0.05).mean())
    assert rate == pytest.approx(t_test_power(1.0, sd, n, paired=True), abs=0.015)


def test_planning_edge_cases_and_bad_values():
    assert t_test_power(0.0, 1.0, 10) == pytest.approx(0.05)  # no difference: rejected at the level
    assert repeats_needed(0.0, 1.0) == 100_001  # past `most`: no count finds it
    assert repeats_needed(0.01, 1.0, most=1000) == 1001
    assert repeats_needed(-0.5, 1.0) == 64  # the sign does not matter
    # two seeds paired (df 1), 8 sd apart: scipy's far tail is NaN there; the power is the near tail's
    assert t_test_power(8.0, 1.0, 2, paired=True) == pytest.approx(0.6252781277, abs=1e-9)
    for bad in (dict(n=1), dict(sd=0.0), dict(alpha=1.0)):
        kw = {"effect": 1.0, "sd": 1.0, "n": 5, **bad}
        with pytest.raises(ValueError, match="t_test_power: n >= 2, sd > 0"):
            t_test_power(**kw)
    with pytest.raises(ValueError, match="0 < power < 1"):
        repeats_needed(1.0, 1.0, power=1.0)


def test_pass_at_k_is_the_share_of_k_subsets_holding_a_correct_sample():
    """The unbiased estimator against brute force: every k-subset of each question's samples enumerated."""
    import itertools

    rng = np.random.default_rng(0)
    table = [list(rng.integers(0, 2, size=n) * (rng.random() < 0.8)) for n in (8, 8, 6, 8, 7, 8)]
    for k in (1, 2, 3, 4, 6):
        per_q = [np.mean([any(sub) for sub in itertools.combinations(xs, k)]) for xs in table]
        out = pass_at_k(table, k)
        assert out["value"] == pytest.approx(np.mean(per_q), abs=1e-12)
        assert out["stderr"] == pytest.approx(np.std(per_q, ddof=1) / math.sqrt(len(per_q)), abs=1e-12)
    assert pass_at_k(table, 1)["value"] == pytest.approx(clustered_accuracy(table)["accuracy"])
    assert pass_at_k({"q": [0, 0, 1, 0]}, 4)["value"] == 1.0 and math.isnan(pass_at_k({"q": [0, 1]}, 2)["stderr"])
    with pytest.raises(ValueError, match="pass@8: a question has 6 samples"):
        pass_at_k(table, 8)


def test_majority_vote_takes_the_most_given_answer_first_on_ties_and_skips_the_unanswered():
    answers = {
        "a": [("3", False), ("5", True), ("5", True), ("3", False)],  # a tie: the answer given first, 3, is wrong
        "b": [("", False), ("", False), ("7", True)],  # only one sample answered: it decides
        "c": [("", False), ("", False)],  # nobody answered: 0
        "d": [("1/2", True), ("1/2", False), ("2", False)],  # one sample of the answer graded correct: correct
    }
    out = majority_vote(answers)
    assert out["value"] == pytest.approx((0 + 1 + 0 + 1) / 4)
    assert out["stderr"] == pytest.approx(np.std([0, 1, 0, 1], ddof=1) / 2)
