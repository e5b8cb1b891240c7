"""Tests for opdkit.grading: box extraction, normalization, equivalence, batch grading."""

import threading

import pytest

from opdkit.grading import extract_boxed, grade_answer, grade_completion, grade_many, normalize_answer


@pytest.mark.parametrize("text, expected", [
    (r"so \boxed{5}.", "5"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{\frac{\sqrt{3}}{2}} done", r"\frac{\sqrt{3}}{2}"),
    (r"first \boxed{3}, then \boxed{4}", "4"),  # several boxes: the last one
    (r"\fbox{7}", "7"),
    (r"\boxed{1} then \fbox{2}", "2"),
    (r"$\boxed 5$", "5"),  # space form stops at $
    (r"answer: \boxed 42", "42"),  # space form stops at end
    (r"\boxed{\{1,2\}}", r"\{1,2\}"),  # escaped braces do not count
    (r"\boxed{ 12 }", "12"),
    ("no box here", None),
    (r"\boxed{\frac{1}{2}", None),  # unbalanced (truncated generation)
    (r"\boxed{1} and later \boxed{2", None),  # last box unbalanced -> None, not the earlier one
    (r"\boxed", None),
    (r"\boxedfoo{3}", None),  # another command, not a box
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize("raw, expected", [
    (" $1,000$ ", "1000"),
    ("10.0", "10"),
    ("2.50", "2.5"),
    ("+7", "7"),
    ("-0.0", "0"),
    (r"\text{Monday}.", "Monday"),
    (r"\left( 1, 2 \right)", "(1,2)"),
    (r"1\!000", "1000"),
    (r"\dfrac{1}{2}", r"\frac{1}{2}"),
    ("1,2", "1,2"),  # a list, not a thousands separator
    (r"\leftarrow", r"\leftarrow"),
])
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected


@pytest.mark.parametrize("pred, gold", [
    ("1/2", r"\frac{1}{2}"),
    (r"\frac{1}{2}", "1/2"),
    ("0.5", r"\frac{1}{2}"),
    (r"\frac{1}{2}", "0.5"),
    ("10.0", "10"),
    ("10", "10.0"),
    ("1,000", "1000"),
    ("1000", "1,000"),
    ("-23", "-23"),
    (r"\sqrt{12}", r"2\sqrt{3}"),
    ("5", "x=5"),  # gold-side assignment is simplified (why gold goes first)
])
def test_equivalent(pred, gold):
    assert grade_answer(pred, gold)


@pytest.mark.parametrize("pred, gold", [
    ("3", "4"),
    ("2", "1/2"),
    ("1/2", "2"),
    ("23", "-23"),
    ("-23", "23"),
    ("", "5"),
])
def test_not_equivalent(pred, gold):
    assert not grade_answer(pred, gold)


def test_none_is_wrong():
    assert grade_answer(None, "5") is False
    assert grade_completion("I think it is 5.", "5") == {"pred": None, "correct": False,
                                                         "has_box": False, "graded_by": None}


def test_grade_completion():
    out = grade_completion(r"So $x = \boxed{\dfrac{1}{2}}$.", "0.5")
    assert out == {"pred": r"\dfrac{1}{2}", "correct": True, "has_box": True, "graded_by": "verifier"}


# (pred, gold, who accepts it): the rule grader for the same answer written another way, the verifier for
# an equal value in another form, nobody for a different value (mathematical facts, not the code's output)
@pytest.mark.parametrize("pred, gold, who", [
    ("204", "204", "rule"),  # AIME-style
    ("1,000", "1000", "rule"),
    (r"\dfrac{1}{2}", r"\frac{1}{2}", "rule"),
    (r"\text{(B)}", "(B)", "rule"),
    ("10.0", "10", "rule"),
    (r"\frac{1}{2}", "0.5", "verifier"),
    ("1/2", r"\frac{1}{2}", "verifier"),
    (r"\sqrt{12}", r"2\sqrt{3}", "verifier"),
    (r"2^{10}", "1024", "verifier"),
    ("5", "x=5", "verifier"),
    (r"\pi/2", r"\frac{\pi}{2}", "verifier"),
    ("203", "204", None),
    (r"\sqrt{13}", r"2\sqrt{3}", None),
    ("1/3", "0.33", None),
])
def test_rule_grader_then_verifier(pred, gold, who):
    from opdkit.grading import accepted_by

    assert accepted_by(pred, gold) == who
    assert grade_completion(rf"... \boxed{{{pred}}}", gold)["graded_by"] == who


def test_the_verifier_is_asked_only_when_the_rule_grader_says_no(monkeypatch):
    from opdkit import grading

    calls = []
    monkeypatch.setattr(grading, "_math_verify_equal", lambda p, g, strict=False: calls.append((p, g)) or False)
    assert grading.accepted_by("1,000", "1000") == "rule" and calls == []
    assert grading.accepted_by("1/2", "0.5") is None and calls == [("1/2", "0.5")]


def test_garbage_is_wrong_not_an_error():
    assert not grade_answer(r"\frac{{}}{", "5")
    assert not grade_answer("}}}{{{\\", r"\frac{1}{2}")


def test_refuses_non_main_thread():
    errors = []

    def run():
        try:
            grade_answer("1/2", "0.5")
        except RuntimeError as e:
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert len(errors) == 1 and "main thread" in str(errors[0])


COMPLETIONS = [r"\boxed{1/2}", r"\boxed{0.5}", r"\boxed{1/2}", "no box", r"\boxed{3}",
               r"\boxed{-23}", r"\boxed{23}", r"\boxed{1,000}", r"\boxed{1/2"]
GOLDS = [r"\frac{1}{2}", r"\frac{1}{2}", r"\frac{1}{2}", "4", "4", "-23", "-23", "1000", "1/2"]
EXPECTED = [True, True, True, False, False, True, False, True, False]


def test_grade_many_sequential():
    out = grade_many(COMPLETIONS, GOLDS)
    assert [r["correct"] for r in out] == EXPECTED
    assert [r["graded_by"] for r in out] == ["verifier", "verifier", "verifier", None, None, "rule", None, "rule", None]
    assert [r["has_box"] for r in out] == [c not in ("no box", r"\boxed{1/2") for c in COMPLETIONS]
    assert out == [grade_completion(c, g) for c, g in zip(COMPLETIONS, GOLDS)]


def test_grade_many_processes_match_sequential():
    assert grade_many(COMPLETIONS, GOLDS, processes=2) == grade_many(COMPLETIONS, GOLDS)


def test_grade_many_length_mismatch():
    with pytest.raises(ValueError, match="one gold answer per completion"):
        grade_many(["a", "b"], ["a"])


def test_answer_line_is_the_fallback_for_answer_line_prompts():
    from opdkit.grading import extract_answer

    assert extract_answer("work...\nAnswer: 42") == "42"
    assert extract_answer("Answer: 1\nmore\nAnswer: 7.") == "7"
    assert extract_answer("Answer: 3 but \\boxed{5}") == "5"  # a box wins
    assert extract_answer("no answer here") is None
    assert grade_completion("so\nAnswer: \\frac{1}{2}", "0.5")["correct"]
