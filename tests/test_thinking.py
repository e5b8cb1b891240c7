"""Qwen3's thinking switch (``data.enable_thinking``, ``data.teacher_enable_thinking``): on the real-scale
fixture's Qwen3 tokenizer and chat template, the OPSD recipe's rendered student and teacher prompts are
byte for byte (and token for token) the released collator's, as an independent jinja2 rendering of the
template text with the released collator's messages and kwargs gives them; the doctor reports each side's
thinking state; a teacher model with a thinking setting of its own is refused."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import jinja2.sandbox
import pytest

from opdkit.cli import main as opdkit_main
from opdkit.data import encode_prompt, load_examples, render_prompt
from opdkit.models import load_tokenizer
from opdkit.pairs import check_inputs
from opdkit.recipes import load_config
from qwen2_fixture import copy_model, fixture_dir

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def fx(tmp_path_factory) -> Path:
    return fixture_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def qwen3_student(fx, tmp_path_factory) -> Path:
    """The fixture's student weights beside the Qwen3 tokenizer and chat template (151,669 ids < 151,936 rows)."""
    d = copy_model(fx / "student", tmp_path_factory.mktemp("q3") / "student",
                   skip=("tokenizer.json", "tokenizer_config.json"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (d / name).symlink_to(fx / "qwen3" / name)
    return d


# The released collator's messages, as its f-strings write them (siyan-zhao/OPSD data_collator.py, the release
# with student_thinking / teacher_thinking: student_thinking defaults to False, the recipe sets teacher_thinking=false)
def released_student(problem: str) -> str:
    return f"Problem: {problem}\n\nPlease reason step by step, and put your final answer within \\boxed{{}}."


def released_teacher(problem: str, solution: str) -> str:
    transition = ("\n\nAfter reading the reference solution above, make sure you truly understand "
                  "the reasoning behind each step — do not copy or paraphrase it. Now, using your "
                  "own words and independent reasoning, derive the same final answer to the problem above. "
                  "Think step by step, explore different approaches, and don't be afraid to backtrack "
                  "or reconsider if something doesn't work out:\n")
    return (f"Problem: {problem}\n\n"
            f"Here is a reference solution to this problem:\n"
            f"=== Reference Solution Begin ===\n{solution}\n=== Reference Solution End ===\n"
            f"{transition}\n"
            f"Please reason step by step, and put your final answer within \\boxed{{}}.")


def jinja_render(template: str, content: str, **kwargs) -> str:
    """The template rendered by jinja2 itself, in the environment HF documents for chat templates
    (sandboxed, trim_blocks, lstrip_blocks): one user message and the generation prompt."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=[{"role": "user", "content": content}], add_generation_prompt=True,
                                            **kwargs)


def test_the_opsd_recipe_renders_the_released_collators_prompts_byte_for_byte(fx):
    cfg = load_config(None, ROOT / "recipes" / "opsd_released.yaml")
    tok = load_tokenizer(fx / "qwen3")
    template = json.loads((fx / "qwen3" / "tokenizer_config.json").read_text())["chat_template"]
    assert len(tok) == 151669 and tok.convert_tokens_to_ids(["<think>", "</think>"]) == [151667, 151668]
    assert "enable_thinking is defined and enable_thinking is false" in template
    rows = load_examples(fx / "data" / "eval.parquet", cfg.data)[:4]  # MATH-500-shaped rows: problem, solution
    assert len(rows) == 4 and all(ex.solution for ex in rows)
    for ex in rows:
        student = jinja_render(template, released_student(ex.problem_text), enable_thinking=False)
        teacher = jinja_render(template, released_teacher(ex.problem_text, ex.solution), enable_thinking=False)
        assert render_prompt(ex, tok, cfg.data) == student
        assert render_prompt(ex, tok, cfg.data, privileged=True) == teacher
        # the collator tokenizes its rendered text (Qwen's tokenizer adds no special tokens)
        assert encode_prompt(ex, tok, cfg.data) == tok(student).input_ids
        assert encode_prompt(ex, tok, cfg.data, privileged=True) == tok(teacher).input_ids
        # no thinking: the answer opens with the template's empty think block (ids 151667 '\n\n' 151668 '\n\n')
        assert student.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert encode_prompt(ex, tok, cfg.data)[-4:] == [151667, 271, 151668, 271]
    # thinking on is the template's default (the kwarg undefined): no block, the model opens its own
    on = load_config(None, ROOT / "recipes" / "opsd_released.yaml", ["data.enable_thinking=true"])
    ex = rows[0]
    assert render_prompt(ex, tok, on.data) == jinja_render(template, released_student(ex.problem_text))
    assert render_prompt(ex, tok, on.data).endswith("<|im_start|>assistant\n")


def test_the_eval_student_prompt_switch_gives_the_benchmarks_prompt_byte_for_byte(fx, monkeypatch):
    """Seed 004's OPSD_STUDENT_PROMPT=eval is "byte-identical to the benchmark prompt": the student's rendered prompt
    is the one `opdkit eval` renders for the benchmark (its message and its eval.enable_thinking, on), token for
    token. It was the evaluator's message under the student's switch (off): Qwen3's empty think block more.
    paper stays the released collator's prompt, without thinking."""
    import opdkit.evaluate as evaluate
    from opdkit.recipes import opsd_overrides

    class Rendered(Exception):
        pass

    seen = []

    def sample_answers(model, tokenizer, examples, data, ev, *args, **kwargs):  # the benchmark's data config
        seen.append(data)
        raise Rendered

    monkeypatch.setattr(evaluate, "sample_answers", sample_answers)
    tok = load_tokenizer(fx / "qwen3")
    for value in ("eval", "paper"):
        cfg = load_config(None, ROOT / "recipes" / "opsd_released.yaml",
                          opsd_overrides({"OPSD_STUDENT_PROMPT": value}))
        rows = load_examples(fx / "data" / "eval.parquet", cfg.data)[:4]
        with pytest.raises(Rendered):
            evaluate.evaluate(None, tok, rows, cfg.data, cfg.eval, progress=False)
        bench = seen.pop()
        for ex in rows:
            student, benchmark = render_prompt(ex, tok, cfg.data), render_prompt(ex, tok, bench)
            if value == "eval":
                assert student == benchmark and encode_prompt(ex, tok, cfg.data) == encode_prompt(ex, tok, bench)
            else:
                assert student == jinja_render(json.loads((fx / "qwen3" / "tokenizer_config.json").read_text())[
                    "chat_template"], released_student(ex.problem_text), enable_thinking=False) != benchmark


def test_a_template_without_the_switch_renders_the_same_either_way(fx):
    """Qwen2.5's template (the fixture's student; DeepSeek-R1-Distill-Qwen's is alike) does not read it."""
    tok = load_tokenizer(fx / "student")
    cfg = load_config(None, ROOT / "recipes" / "s1.yaml")
    ex = load_examples(fx / "data" / "train.parquet", cfg.data)[0]
    off = load_config(None, ROOT / "recipes" / "s1.yaml", ["data.enable_thinking=false"])
    assert render_prompt(ex, tok, cfg.data) == render_prompt(ex, tok, off.data)


def _cfg(student: Path, data: Path, *overrides: str):
    return load_config(None, ROOT / "recipes" / "opsd_released.yaml",
                       [f"student.path={student}", f"data.train={data}", *overrides])


def test_the_pair_checks_report_each_sides_thinking_state(fx, qwen3_student):
    data = fx / "data" / "eval.parquet"
    _, found = check_inputs(_cfg(qwen3_student, data), strict=False)
    (line,) = [f for f in found if f.check == "thinking"]
    assert line.status == "OK" and "reads enable_thinking" in line.detail
    assert "student's prompts off" in line.detail and "privileged teacher's prompt off" in line.detail
    _, found = check_inputs(_cfg(qwen3_student, data, "data.teacher_enable_thinking=true"), strict=False)
    (line,) = [f for f in found if f.check == "thinking"]
    assert "student's prompts off" in line.detail and "privileged teacher's prompt on" in line.detail
    # the Qwen2.5 template ignores it: said so, and a false setting is a warning
    _, found = check_inputs(_cfg(fx / "student", data), strict=False)
    (line,) = [f for f in found if f.check == "thinking"]
    assert line.status == "WARN" and "does not read enable_thinking" in line.detail


def test_a_teacher_model_with_a_thinking_setting_of_its_own_is_refused(fx, qwen3_student, tmp_path, capsys):
    """A teacher model scores the student's prompt tokens: data.teacher_enable_thinking cannot differ there."""
    overrides = ["teacher.source=model", f"teacher.path={fx / 'teacher'}", "data.enable_thinking=true",
                 "data.teacher_enable_thinking=false"]
    _, found = check_inputs(_cfg(qwen3_student, fx / "data" / "eval.parquet", *overrides), strict=False)
    (line,) = [f for f in found if f.check == "thinking"]
    assert line.status == "FAIL" and "scores the student's prompt tokens" in line.detail
    assert "data.teacher_enable_thinking=true" in line.fix
    out = tmp_path / "out"
    recipe = ROOT / "recipes" / "opsd_released.yaml"
    code = opdkit_main(["train", "--check", "--out", str(out), "-p", "none", "-r", str(recipe),
                        "-S", f"student.path={qwen3_student}", "-S", f"data.train={fx / 'data' / 'eval.parquet'}",
                        *[x for o in overrides for x in ("-S", o)]])
    assert code == 2 and "data.teacher_enable_thinking=false differs" in capsys.readouterr().err
    assert not out.exists()
