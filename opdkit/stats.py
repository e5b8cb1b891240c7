"""Statistics for evals and runs: clustered accuracy, seed repeats, arm comparisons, repeats to plan, binning.

Pure functions over plain lists / numpy arrays. Axis names (docs/design.md, "Style"): ``P`` questions
(prompts), ``G`` samples per question (may differ per question: ``G_p``), ``R`` runs (seeds).

Error bars follow Miller 2024, "Adding Error Bars to Evals" (arXiv 2411.00640): the unit of
independence is the question, not the sample. Accuracy is the question-weighted mean of
per-question means ``s_p``; since the ``s_p`` are i.i.d. draws (question from the benchmark
distribution, then ``G_p`` samples for it), its standard error is

    SE = sd(s_p, ddof=1) / sqrt(P) = sqrt( sum_p (s_p - mean(s))^2 / (P * (P - 1)) ),

which counts both between-question spread and the within-question sampling noise left in each
``s_p``. With equal ``G_p`` it equals Miller's cluster-robust SE of the pooled mean (up to the
``P/(P-1)`` small-sample factor). Samples of one question are correlated, so the naive
``sqrt(p(1-p)/N)`` over all ``N`` samples understates the SE whenever questions differ in
difficulty.

p-values are two-sided, from scipy's Student t distribution (Welch-Satterthwaite degrees of
freedom for unpaired arms, P - 1 for paired questions): the same numbers as
``scipy.stats.ttest_ind(equal_var=False)`` and ``scipy.stats.ttest_rel``. Results carry
``p_method: "t"``.

Planning repeats (``t_test_power``, ``repeats_needed``, ``detectable_effect``): the power of the
two-sided t-test from the noncentral t distribution, as G*Power and ``statsmodels.stats.power``
compute it: how many seeds per arm find a difference, and what difference a number of seeds finds.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence

import numpy as np

CorrectTable = Sequence[Sequence[float]] | Mapping[Hashable, Sequence[float]]


def _two_sided_p(t: float, df: float) -> tuple[float, str]:
    """Two-sided p-value of statistic ``t`` with ``df`` degrees of freedom (Student t), and the
    method (``"t"``; ``"none"`` with a NaN p when t or df is undefined; t = +-inf gives 0)."""
    if math.isnan(t) or not df > 0:
        return float("nan"), "none"
    from scipy.stats import t as student_t  # here: importing scipy.stats costs every importer ~1.2 s of CPU

    return float(2.0 * student_t.sf(abs(t), df)), "t"


def _ratio(diff: float, se: float) -> float:
    """diff / se, with NaN for 0/0 and signed inf for x/0."""
    if se > 0:
        return diff / se
    return float("nan") if diff == 0 else math.copysign(math.inf, diff)


def per_question_means(correct: CorrectTable) -> tuple[list, np.ndarray]:
    """Question ids and per-question mean correctness.

    ``correct``: P questions, each a non-empty list of G_p scores in [0, 1] (0/1 correctness);
    a list (ids are 0..P-1) or a dict ``{qid: scores}``. Returns ``(qids, s_P)``.
    """
    items = list(correct.items()) if isinstance(correct, Mapping) else list(enumerate(correct))
    if not items:
        raise ValueError("no questions: pass one list of sample scores per question")
    qids, means = [], []
    for qid, scores in items:
        x_G = np.asarray(scores, dtype=float)
        if x_G.ndim != 1 or x_G.size == 0:
            raise ValueError(f"question {qid!r}: expected a non-empty 1-D list of scores, "
                             f"got shape {x_G.shape}")
        if np.any((x_G < 0) | (x_G > 1)) or np.any(np.isnan(x_G)):
            raise ValueError(f"question {qid!r}: scores must lie in [0, 1], got {scores!r}")
        qids.append(qid)
        means.append(x_G.mean())
    return qids, np.asarray(means)


def clustered_accuracy(correct: CorrectTable) -> dict:
    """Question-weighted accuracy with a question-clustered standard error.

    ``correct``: P questions x G_p samples (ragged list of lists, or ``{qid: list}``), 0/1 each.

    Returns ``accuracy`` = mean_p s_p (s_p = mean of question p's samples); ``stderr`` =
    sd(s_P, ddof=1) / sqrt(P) (NaN when P = 1); ``accuracy_pooled`` = sum of all scores / N and
    ``stderr_naive`` = sqrt(q (1 - q) / N) with q = accuracy_pooled, i.e. all N samples treated as
    independent (for comparison only); ``n_questions`` = P, ``n_samples`` = N = sum_p G_p,
    ``samples_per_question`` = N / P.
    """
    items = correct.values() if isinstance(correct, Mapping) else correct
    _, s_P = per_question_means(correct)
    n_P = np.asarray([len(x) for x in items], dtype=float)
    P, N = len(s_P), int(n_P.sum())
    pooled = float((s_P * n_P).sum() / N)
    return {
        "accuracy": float(s_P.mean()),
        "stderr": float(s_P.std(ddof=1) / math.sqrt(P)) if P > 1 else float("nan"),
        "accuracy_pooled": pooled,
        "stderr_naive": math.sqrt(pooled * (1.0 - pooled) / N),
        "n_questions": P,
        "n_samples": N,
        "samples_per_question": N / P,
    }


def pass_at_k(correct: CorrectTable, k: int) -> dict:
    """pass@k over questions: per question p with n_p samples, c_p of them correct, the unbiased estimator
    1 - C(n_p - c_p, k) / C(n_p, k) (the chance that k of its samples drawn without replacement hold a correct
    one; Chen et al. 2021), averaged over questions, with the question-clustered standard error
    (sd(ddof=1) / sqrt(P), NaN for one question). pass@1 is ``clustered_accuracy``'s accuracy. ``ValueError``
    where a question has fewer than k samples."""
    items = correct.values() if isinstance(correct, Mapping) else correct
    est = []
    for xs in items:
        n, c = len(xs), int(sum(bool(x) for x in xs))
        if n < k:
            raise ValueError(f"pass@{k}: a question has {n} samples, fewer than k")
        est.append(1.0 - math.comb(n - c, k) / math.comb(n, k))
    e_P = np.asarray(est, dtype=float)
    P = len(e_P)
    return {"k": k, "value": float(e_P.mean()),
            "stderr": float(e_P.std(ddof=1) / math.sqrt(P)) if P > 1 else float("nan")}


def majority_vote(answers: Mapping[str, Sequence[tuple[str, bool]]]) -> dict:
    """maj@n: per question, the answer its samples give most often (``answers``: question id -> each sample's
    (normalised answer, correct); samples without an answer, "", do not vote; a tie goes to the answer given
    first), scored as correct where any sample giving that answer was graded correct; the mean over questions (a
    question with no answer scores 0), with the question-clustered standard error."""
    votes = []
    for samples in answers.values():
        counts: dict[str, int] = {}
        graded: dict[str, bool] = {}
        for ans, ok in samples:
            if ans:
                counts[ans] = counts.get(ans, 0) + 1
                graded[ans] = graded.get(ans, False) or bool(ok)
        best = max(counts, key=lambda a: counts[a]) if counts else None  # max keeps the first of equal counts
        votes.append(float(graded[best]) if best is not None else 0.0)
    v_P = np.asarray(votes, dtype=float)
    P = len(v_P)
    return {"value": float(v_P.mean()), "stderr": float(v_P.std(ddof=1) / math.sqrt(P)) if P > 1 else float("nan")}


def repeat_stats(values: Sequence[float]) -> dict:
    """Summary of R repeated measurements (e.g. one accuracy per seed).

    ``values``: R floats. Returns ``mean``, ``sd`` (ddof=1), ``se`` = sd / sqrt(R), ``n`` = R,
    ``min``, ``max``. ``sd`` and ``se`` are NaN when R = 1.
    """
    x_R = np.asarray(values, dtype=float)
    if x_R.ndim != 1 or x_R.size == 0:
        raise ValueError(f"repeat_stats: expected a non-empty 1-D list, got shape {x_R.shape}")
    R = x_R.size
    sd = float(x_R.std(ddof=1)) if R > 1 else float("nan")
    return {"mean": float(x_R.mean()), "sd": sd, "se": sd / math.sqrt(R), "n": R,
            "min": float(x_R.min()), "max": float(x_R.max())}


def compare_arms(arm: Sequence[float], baseline: Sequence[float]) -> dict:
    """Unpaired comparison of two sets of repeats (e.g. per-seed accuracies of two arms).

    ``arm``: R_a floats, ``baseline``: R_b floats, R_a, R_b >= 2. Returns ``diff`` =
    mean(arm) - mean(baseline); ``se`` = sqrt(se_a^2 + se_b^2) with se = sd(ddof=1)/sqrt(R)
    (Welch); ``diff_in_se`` = diff / se; ``df`` = Welch-Satterthwaite degrees of freedom
    ``se^4 / (se_a^4/(R_a-1) + se_b^4/(R_b-1))``; ``p_value`` two-sided Welch t-test (as
    ``scipy.stats.ttest_ind(arm, baseline, equal_var=False)``), ``p_method``; and both arms'
    ``repeat_stats``.
    When both arms have zero spread, ``se`` = 0 and ``df``/``p_value`` are NaN.
    """
    a, b = repeat_stats(arm), repeat_stats(baseline)
    if a["n"] < 2 or b["n"] < 2:
        raise ValueError(f"compare_arms needs >= 2 repeats per arm, got {a['n']} and {b['n']}")
    diff = a["mean"] - b["mean"]
    var_a, var_b = a["se"] ** 2, b["se"] ** 2
    se = math.sqrt(var_a + var_b)
    denom = var_a**2 / (a["n"] - 1) + var_b**2 / (b["n"] - 1)
    df = (var_a + var_b) ** 2 / denom if denom > 0 else float("nan")
    t = _ratio(diff, se)
    p, method = _two_sided_p(t, df)
    return {"diff": diff, "se": se, "diff_in_se": t, "df": df, "p_value": p,
            "p_method": method, "arm": a, "baseline": b}


def paired_question_diff(correct_a: CorrectTable, correct_b: CorrectTable) -> dict:
    """Difference of two evals on the same P questions, with a paired question-clustered SE.

    ``correct_a``, ``correct_b``: tables as in ``clustered_accuracy`` over the same questions
    (lists: same order and length; dicts: same keys); sample counts may differ. With
    d_p = s_p^a - s_p^b: ``diff`` = mean(d_P) (= accuracy_a - accuracy_b), ``se`` =
    sd(d_P, ddof=1) / sqrt(P), ``diff_in_se``, ``p_value`` (paired t-test, df = P - 1, as
    ``scipy.stats.ttest_rel(s_a, s_b)``), ``p_method``, ``n_questions``, and ``se_unpaired`` =
    sqrt(SE_a^2 + SE_b^2) for reference:
    pairing removes the shared question difficulty, so usually se < se_unpaired.
    """
    qids_a, s_a = per_question_means(correct_a)
    qids_b, s_b = per_question_means(correct_b)
    if isinstance(correct_a, Mapping) != isinstance(correct_b, Mapping):
        raise ValueError("paired_question_diff: pass two dicts or two lists, not one of each")
    if isinstance(correct_a, Mapping):
        if set(qids_a) != set(qids_b):
            only_a, only_b = set(qids_a) - set(qids_b), set(qids_b) - set(qids_a)
            raise ValueError(f"paired_question_diff: question ids differ; only in a: "
                             f"{sorted(map(repr, only_a))[:5]}, only in b: "
                             f"{sorted(map(repr, only_b))[:5]}")
        index_b = {q: i for i, q in enumerate(qids_b)}
        s_b = s_b[[index_b[q] for q in qids_a]]  # reorder b to a's question order
    elif len(s_a) != len(s_b):
        raise ValueError(f"paired_question_diff: {len(s_a)} questions in a, {len(s_b)} in b")
    P = len(s_a)
    d_P = s_a - s_b
    diff = float(d_P.mean())
    se = float(d_P.std(ddof=1) / math.sqrt(P)) if P > 1 else float("nan")
    se_a = s_a.std(ddof=1) / math.sqrt(P) if P > 1 else float("nan")
    se_b = s_b.std(ddof=1) / math.sqrt(P) if P > 1 else float("nan")
    t = _ratio(diff, se)
    p, method = _two_sided_p(t, P - 1)
    return {"diff": diff, "se": se, "diff_in_se": t, "p_value": p, "p_method": method,
            "n_questions": P, "se_unpaired": float(math.sqrt(se_a**2 + se_b**2))}


def t_test_power(effect: float, sd: float, n: int, *, paired: bool = False, alpha: float = 0.05) -> float:
    """Power of the two-sided t-test at level ``alpha`` to find a true difference ``effect`` between two arms of
    ``n`` repeats each. Unpaired: Student's two-sample test (df = 2n - 2), ``sd`` each run's spread in either arm
    (the arms equally spread); ``paired``: the one-sample test of the n per-seed differences (df = n - 1), ``sd``
    the spread of one difference. From the noncentral t distribution (noncentrality effect / (sd sqrt(2/n)), or
    sqrt(1/n) paired), as G*Power and ``statsmodels.stats.power`` compute it. The reports test with Welch's
    unequal-variance t (``compare_arms``); with equal sizes and spreads the two agree, so this is the planning
    figure for them."""
    if n < 2 or not sd > 0 or not 0 < alpha < 1:
        raise ValueError(f"t_test_power: n >= 2, sd > 0 and 0 < alpha < 1 expected, got n={n}, sd={sd}, "
                         f"alpha={alpha}")
    from scipy.stats import nct, t as student_t

    df = n - 1 if paired else 2 * n - 2
    ncp = abs(effect) / (sd * math.sqrt((1 if paired else 2) / n))  # the power is the same either way round
    crit = student_t.ppf(1 - alpha / 2, df)
    far = nct.cdf(-crit, df, ncp)  # rejected on the other side: scipy 1.17 gives NaN for it only from ncp ~7.5 on,
    # where it is below 1e-14 (df 1 to 1e5, ncp 0 to 60 scanned at 0.01 on 2026-12-04)
    return float(nct.sf(crit, df, ncp) + (far if math.isfinite(far) else 0.0))


def repeats_needed(effect: float, sd: float, *, power: float = 0.8, alpha: float = 0.05, paired: bool = False,
                   most: int = 100_000) -> int:
    """The fewest repeats per arm (>= 2) at which ``t_test_power`` of ``effect`` reaches ``power``; ``most`` + 1
    when even ``most`` do not (an effect of 0, or one far below the spread)."""
    if not 0 < power < 1:
        raise ValueError(f"repeats_needed: 0 < power < 1 expected, got {power}")
    if effect == 0 or t_test_power(effect, sd, most, paired=paired, alpha=alpha) < power:
        return most + 1
    lo, hi = 1, 2  # power rises with n: the first n that reaches it, by doubling then bisection
    while t_test_power(effect, sd, hi, paired=paired, alpha=alpha) < power:
        lo, hi = hi, min(2 * hi, most)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if t_test_power(effect, sd, mid, paired=paired, alpha=alpha) >= power else (mid, hi)
    return hi


def detectable_effect(sd: float, n: int, *, power: float = 0.8, alpha: float = 0.05, paired: bool = False) -> float:
    """The smallest true difference that ``n`` repeats per arm find with probability ``power``
    (``t_test_power`` = ``power``), in the units of ``sd``."""
    if not 0 < power < 1:
        raise ValueError(f"detectable_effect: 0 < power < 1 expected, got {power}")
    from scipy.optimize import brentq

    hi = sd
    while t_test_power(hi, sd, n, paired=paired, alpha=alpha) < power:
        hi *= 2
    return float(brentq(lambda e: t_test_power(e, sd, n, paired=paired, alpha=alpha) - power, 0.0, hi, xtol=1e-10))


def kl_bin_means(values: Sequence[float], keys: Sequence[float],
                 edges: Sequence[float]) -> list[dict]:
    """Mean of ``values`` within bins of ``keys`` (e.g. per-token KL binned by position).

    ``values``, ``keys``: N floats each (arrays are flattened, so ``kl_B_T`` with ``pos_B_T``
    works); ``edges``: E + 1 strictly increasing bin edges. Bin e holds keys in
    [edges[e], edges[e+1]), the last bin also includes its right edge (numpy.histogram's rule);
    keys outside [edges[0], edges[-1]] are dropped. Non-finite values are dropped (mask padding
    with NaN). Returns E dicts ``{"lo", "hi", "mean", "count"}``, mean NaN when count is 0.
    """
    v_N = np.asarray(values, dtype=float).reshape(-1)  # flatten any leading axes to N
    k_N = np.asarray(keys, dtype=float).reshape(-1)
    e_E1 = np.asarray(edges, dtype=float)
    if v_N.shape != k_N.shape:
        raise ValueError(f"kl_bin_means: {v_N.size} values but {k_N.size} keys")
    if e_E1.ndim != 1 or e_E1.size < 2 or np.any(np.diff(e_E1) <= 0):
        raise ValueError(f"kl_bin_means: edges must be >= 2 strictly increasing numbers, "
                         f"got {list(edges)!r}")
    E = e_E1.size - 1
    keep_N = np.isfinite(v_N) & (k_N >= e_E1[0]) & (k_N <= e_E1[-1])
    v_N, k_N = v_N[keep_N], k_N[keep_N]
    bin_N = np.clip(np.searchsorted(e_E1, k_N, side="right") - 1, 0, E - 1)
    count_E = np.bincount(bin_N, minlength=E)
    sum_E = np.bincount(bin_N, weights=v_N, minlength=E)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_E = np.where(count_E > 0, sum_E / np.maximum(count_E, 1), np.nan)
    return [{"lo": float(e_E1[e]), "hi": float(e_E1[e + 1]), "mean": float(mean_E[e]),
             "count": int(count_E[e])} for e in range(E)]


def summarize_runs(records: Sequence[Mapping], group_key: str = "arm",
                   value_key: str = "accuracy") -> dict:
    """Group eval records by ``group_key`` and summarize ``value_key`` across seeds.

    ``records``: R dicts, each with at least ``group_key``, ``"seed"``, ``value_key`` and
    ``"stderr"`` (the within-eval SE of that run). A (group, seed) pair may appear once.
    Returns ``{group: repeat_stats(values) | {"seeds": [...], "mean_stderr": mean within-eval
    SE}}`` in first-seen group order. Compare ``sd`` (spread across seeds: training noise plus
    eval noise) with ``mean_stderr`` (eval noise alone) to see which dominates.
    """
    groups: dict = {}
    for i, rec in enumerate(records):
        missing = [k for k in (group_key, "seed", value_key, "stderr") if k not in rec]
        if missing:
            raise ValueError(f"summarize_runs: record {i} lacks keys {missing}; "
                             f"it has {sorted(rec)}")
        g = groups.setdefault(rec[group_key], {"seeds": [], "values": [], "stderrs": []})
        if rec["seed"] in g["seeds"]:
            raise ValueError(f"summarize_runs: record {i} repeats {group_key}="
                             f"{rec[group_key]!r} seed={rec['seed']!r}; drop the duplicate")
        g["seeds"].append(rec["seed"])
        g["values"].append(float(rec[value_key]))
        g["stderrs"].append(float(rec["stderr"]))
    return {name: {**repeat_stats(g["values"]), "seeds": g["seeds"],
                   "mean_stderr": float(np.mean(g["stderrs"]))}
            for name, g in groups.items()}
