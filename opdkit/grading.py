"""Answer extraction and grading for math completions.

A completion is graded by its LAST ``\\boxed{...}`` (or ``\\fbox{...}``; failing that, the last
``Answer:`` line). The extracted answer is compared with the gold answer by the **rule grader** first
(``normalize_answer`` on both, then string equality: cheap, and it decides most matches), and only
when the rule grader says no, by the **verifier**, math-verify's ``verify(parse(gold), parse(pred))``
(symbolic/numeric equivalence: ``1/2 == \\frac{1}{2} == 0.5``, ``\\sqrt{12} == 2\\sqrt{3}``). The
seeded S1 evaluators ran their rule grader with CompassVerifier (a model-based verifier) as the
fallback; math-verify is the fallback that runs here. Each graded record says which one accepted
it (``graded_by``: ``rule`` | ``verifier`` | None when neither did).

A grading *failure* (an exception inside the comparison, e.g. sympy raising on an answer) is "not
equal" for ``opdkit eval`` (``strict=False``); with ``strict=True`` (the training reward,
``opdkit.rewards``) it raises ``GradingError`` instead, so a failure is never silently a zero.

math-verify bounds its parse and compare steps with ``signal.alarm`` timeouts (5 s each), which
only work in the main thread of a process. So ``grade_answer`` refuses to run in another thread,
and ``grade_many`` parallelises with processes, never threads.
"""

from __future__ import annotations

import multiprocessing
import re
import threading
from concurrent.futures import ProcessPoolExecutor

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_UNESCAPED_DOLLAR_RE = re.compile(r"(?<!\\)\$")
_TEXT_WRAPPER_RE = re.compile(r"\\(?:text|textbf|textrm|mathrm|mbox)\{([^{}]*)\}")
_LEFT_RIGHT_RE = re.compile(r"\\(?:left|right)(?![A-Za-z])")
_THOUSANDS_RE = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_PLAIN_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` in ``text``, stripped; else None.

    Nested braces are matched (``\\boxed{\\frac{1}{2}}`` -> ``\\frac{1}{2}``); escaped braces
    (``\\{``, ``\\}``) do not count. The space form ``\\boxed 5`` takes the token after the
    whitespace, up to the next whitespace, ``$`` or end of text. Only the last box counts: if it
    is unbalanced (e.g. a generation truncated mid-answer), the result is None, not an earlier box.
    """
    matches = list(_BOX_RE.finditer(text))
    if not matches:
        return None
    i = matches[-1].end()
    j = i
    while j < len(text) and text[j].isspace():
        j += 1
    if j < len(text) and text[j] == "{":
        depth = 0
        k = j
        while k < len(text):
            c = text[k]
            if c == "\\":
                k += 2  # skip the escaped character (\{, \}, \\)
                continue
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return text[j + 1 : k].strip()
            k += 1
        return None  # unbalanced
    if j == i or j == len(text):
        return None  # "\boxed" glued to something else, or nothing after it
    m = re.match(r"[^\s$]+", text[j:])
    return m.group(0) if m else None


def normalize_answer(s: str) -> str:
    """A canonical string for the cheap first comparison in ``grade_answer``.

    Removes all whitespace, ``$`` (and ``\\$``), ``\\left``/``\\right``, ``\\!``, ``\\,``, ``\\;``,
    unwraps ``\\text{..}``/``\\textbf``/``\\textrm``/``\\mathrm``/``\\mbox``, maps ``\\dfrac``/
    ``\\tfrac`` to ``\\frac``, drops a trailing ``.`` and a leading ``+``. A plain number loses its
    thousands commas (``1,000`` -> ``1000``) and trailing decimal zeros (``10.0`` -> ``10``,
    ``2.50`` -> ``2.5``).
    """
    s = s.replace("\\$", "").replace("$", "")
    s = s.replace("\\!", "").replace("\\,", "").replace("\\;", "")
    s = "".join(s.split())
    s = _LEFT_RIGHT_RE.sub("", s)
    prev = None
    while prev != s:  # unwrap nested \text{\textbf{..}} from the inside out
        prev, s = s, _TEXT_WRAPPER_RE.sub(r"\1", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.rstrip(".")
    if s.startswith("+"):
        s = s[1:]
    if _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
    if _PLAIN_NUMBER_RE.fullmatch(s) and "." in s:
        s = s.rstrip("0").rstrip(".")
    if s == "-0":
        s = "0"
    return s


class GradingError(RuntimeError):
    """The grader failed instead of giving a verdict (``strict=True``)."""


def _math_verify_equal(pred: str, gold: str, strict: bool = False) -> bool:
    """math-verify equivalence of two bare answers; any failure inside math-verify -> False
    (``strict``: ``GradingError``)."""
    from math_verify import parse, verify  # imported lazily: pulls in sympy/antlr (~1 s)
    from math_verify.errors import TimeoutException

    # "$...$" rather than "\boxed{...}": parse finds both, but only the $ form also accepts
    # trailing junk the model puts in a box ("5\%", "2,", "1."). Bare $ inside would end the
    # math span early, so drop them (escaped \$ is kept: math-verify reads it as currency).
    gold_wrapped = "$" + _UNESCAPED_DOLLAR_RE.sub("", gold) + "$"
    pred_wrapped = "$" + _UNESCAPED_DOLLAR_RE.sub("", pred) + "$"
    try:
        # Gold first: verify(gold, target) is asymmetric (assignments like "x=5" and equation
        # intervals are simplified on the gold side only).
        return bool(verify(parse(gold_wrapped), parse(pred_wrapped)))
    except (Exception, TimeoutException) as e:
        if strict:
            raise GradingError(f"math-verify raised {type(e).__name__}: {e}") from e
        # Model outputs are arbitrary text and sympy can raise almost anything on them
        # (RecursionError, TypeError, OverflowError, a TimeoutException (a BaseException) from a
        # late alarm). A grading failure must never crash an eval: the answer is just "not
        # verified equal". Threading misuse is ruled out before this call (see grade_answer).
        return False


def rule_equal(pred: str, gold: str) -> bool:
    """The rule grader: equal after ``normalize_answer`` (both sides)."""
    return normalize_answer(pred) == normalize_answer(gold)


def accepted_by(pred: str | None, gold: str, strict: bool = False) -> str | None:
    """Which grader accepts ``pred`` for ``gold``: ``"rule"``, else ``"verifier"`` (math-verify, asked only
    when the rule grader says no), else None (wrong; also for a None/empty ``pred``).

    Must run in a process's main thread (math-verify's timeouts use ``signal.alarm``).
    ``strict``: a failure inside math-verify raises ``GradingError`` (else it is None: not accepted).
    """
    if pred is None or not pred.strip():
        return None
    if rule_equal(pred, gold):
        return "rule"
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "grade_answer must run in the main thread (math-verify times out with signal.alarm); "
            "use grade_many(..., processes=N) to parallelise instead of threads"
        )
    return "verifier" if _math_verify_equal(pred, gold, strict) else None


def grade_answer(pred: str | None, gold: str, strict: bool = False) -> bool:
    """True if the extracted answer ``pred`` is equivalent to ``gold`` (rule grader, then verifier);
    ``strict``: a failure inside math-verify raises ``GradingError`` (else it is False)."""
    return accepted_by(pred, gold, strict) is not None


_ANSWER_LINE_RE = re.compile(r"^\s*\**Answer\**\s*:\s*(.+?)\s*$", re.MULTILINE)


def extract_answer(text: str) -> str | None:
    """The last ``\\boxed{}`` answer; failing that, the last ``Answer: ...`` line (the DAPO prompt
    format asks for one). None when there is neither."""
    pred = extract_boxed(text)
    if pred is not None:
        return pred
    lines = _ANSWER_LINE_RE.findall(text)
    return lines[-1].strip().rstrip(".") if lines else None


def grade_completion(completion_text: str, gold: str) -> dict:
    """Grade one completion by its last box.

    Returns ``{"pred": str | None, "correct": bool, "has_box": bool, "graded_by": "rule" | "verifier" |
    None}``; ``has_box`` is True when an answer was extracted (an unbalanced final box counts as none).
    """
    pred = extract_answer(completion_text)
    how = accepted_by(pred, gold)
    return {"pred": pred, "correct": how is not None, "has_box": pred is not None, "graded_by": how}


def grade_many(completions: list[str], golds: list[str], processes: int = 0) -> list[dict]:
    """``grade_completion`` over aligned lists (one gold per completion), in order.

    Identical ``(pred, gold)`` pairs are graded once per call. ``processes=0`` grades in this
    (main) thread; ``processes>0`` grades the distinct pairs in a spawn-context process pool
    (spawn, not fork: the caller may hold CUDA or inference-engine threads). Each worker imports
    math-verify (~1-2 s), so a pool only pays off for thousands of distinct pairs.
    """
    if len(completions) != len(golds):
        raise ValueError(
            f"grade_many: {len(completions)} completions but {len(golds)} golds; "
            "pass one gold answer per completion (repeat the gold for each sample)"
        )
    if processes < 0:
        raise ValueError(f"grade_many: processes must be >= 0, got {processes}")
    preds = [extract_answer(c) for c in completions]
    pairs = list(dict.fromkeys((p, g) for p, g in zip(preds, golds) if p is not None))
    if processes == 0 or not pairs:
        verdicts = [accepted_by(p, g) for p, g in pairs]
    else:
        ctx = multiprocessing.get_context("spawn")
        chunksize = max(1, len(pairs) // (4 * processes))
        with ProcessPoolExecutor(max_workers=processes, mp_context=ctx) as pool:
            verdicts = list(
                pool.map(accepted_by, [p for p, _ in pairs], [g for _, g in pairs],
                         chunksize=chunksize)
            )
    verdict_of = dict(zip(pairs, verdicts))
    out = []
    for p, g in zip(preds, golds):
        how = verdict_of[(p, g)] if p is not None else None
        out.append({"pred": p, "correct": how is not None, "has_box": p is not None, "graded_by": how})
    return out
