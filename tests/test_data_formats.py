"""Real data formats (DAPO-Math chat rows, OpenThoughts problem/solution/answer rows, the public MATH-500 and
AIME files' shapes) from parquet files written here, selection filters, prompt formats and chat templates."""

import json
import math
import random

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from opdkit.config import ConfigError, config_from_dict
from opdkit.data import (
    ANSWER_LINE_PREFIX,
    ANSWER_LINE_SUFFIX,
    BOXED_INSTRUCTION,
    DataError,
    Example,
    encode_prompt,
    format_prompt,
    load_examples,
    read_table,
    select,
    token_counter,
)

DAPO_PROBLEMS = [("What is $3+4$?", "7"), ("Find $x$ if $2x=1$.", "\\frac{1}{2}"), ("How many primes are below 20?",
                                                                                    "8")]


def _data(**kw):
    return config_from_dict({"data": kw}).data


def _write(rows, path):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture()
def dapo(tmp_path):
    rows = [{"data_source": "math_dapo", "ability": "MATH",
             "prompt": [{"content": ANSWER_LINE_PREFIX + q + ANSWER_LINE_SUFFIX, "role": "user"}],
             "reward_model": {"ground_truth": a, "style": "rule-lean"}, "extra_info": {"index": f"uuid-{i}"}}
            for i, (q, a) in enumerate(DAPO_PROBLEMS)]
    return _write(rows, tmp_path / "dapo.parquet")


@pytest.fixture()
def openthoughts(tmp_path):
    rows = [
        {"uuid": "a", "problem": "Compute 12*12.", "solution": "12*12 = 144, so \\boxed{144}.", "answer": "144",
         "source": "olympiads"},
        {"uuid": "b", "problem": "Compute 1/4+1/4.", "solution": "Half: \\boxed{\\frac{1}{2}}", "answer": None,
         "source": "amc_aime"},
        {"uuid": "c", "problem": "Sum 1..4.", "solution": "10", "answer": "10", "source": "cn_k12"},
        {"uuid": "d", "problem": "Compute 10^3.", "solution": "It is \\boxed{1,000}, a long and careful derivation.",
         "answer": None, "source": "olympiads"},
    ]
    return _write(rows, tmp_path / "ot.parquet")


@pytest.fixture(scope="module")
def chat_tok():
    """A small byte-level BPE tokenizer with a ChatML chat template (Qwen's format)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    corpus = [q for q, _ in DAPO_PROBLEMS] + [ANSWER_LINE_PREFIX, ANSWER_LINE_SUFFIX, BOXED_INSTRUCTION,
                                              "user assistant"]
    tk.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|im_start|>", "<|im_end|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|im_end|>")
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tok


def test_dapo_rows(dapo):
    exs = load_examples(dapo, _data())
    assert [ex.id for ex in exs] == ["uuid-0", "uuid-1", "uuid-2"]
    assert [ex.answer for ex in exs] == ["7", "\\frac{1}{2}", "8"] and exs[0].source == "math_dapo"
    assert exs[0].problem_text == "What is $3+4$?"  # DAPO's instruction stripped
    # raw + chat template: the messages exactly as stored
    assert format_prompt(exs[0], _data(chat_template=True)) == [
        {"role": "user", "content": ANSWER_LINE_PREFIX + "What is $3+4$?" + ANSWER_LINE_SUFFIX}]
    # answer_line rebuilds DAPO's message from the problem; boxed replaces the instruction
    assert format_prompt(exs[0], _data(prompt_format="answer_line", chat_template=True)) == format_prompt(
        exs[0], _data(chat_template=True))
    assert format_prompt(exs[0], _data(prompt_format="boxed")) == "What is $3+4$?\n" + BOXED_INSTRUCTION
    assert format_prompt(exs[1],
                         _data(prompt_format="raw")) == ANSWER_LINE_PREFIX + "Find $x$ if $2x=1$." + ANSWER_LINE_SUFFIX


def test_openthoughts_rows_and_filters(openthoughts, chat_tok):
    exs = load_examples(openthoughts, _data())
    assert [ex.id for ex in exs] == ["a", "b", "c", "d"]
    assert [ex.answer for ex in exs] == ["144", "\\frac{1}{2}", "10", "1,000"]  # missing answers from the last \boxed{}
    # OPSD's integer answers: the whole (stripped) answer matches -?\d{1,6}; "1,000" does not
    assert [ex.id for ex in load_examples(openthoughts, _data(filters={"answer_regex": r"-?\d{1,6}"}))] == ["a", "c"]
    assert [ex.id for ex in load_examples(openthoughts, _data(filters={"exclude_sources": ["cn_k12",
                                                                                           "amc_aime"]}))] == ["a", "d"]
    # lengths count the student tokenizer's tokens: without it the filter cannot run
    with pytest.raises(DataError, match="tokenizer"):
        load_examples(openthoughts, _data(filters={"min_reference_tokens": 3}))
    counts = {ex.id: len(chat_tok(ex.solution, add_special_tokens=False).input_ids) for ex in exs}
    cut = sorted(counts.values())[1] + 1  # longer than the two shortest
    want = [i for i in "abcd" if counts[i] >= cut]
    assert len(want) == 2
    assert [ex.id for ex in load_examples(openthoughts, _data(filters={"min_reference_tokens": cut}),
                                          tokenizer=chat_tok)] == want
    chosen = load_examples(openthoughts, _data(filters={"answer_regex": r"-?\d{1,6}", "exclude_sources": ["cn_k12"]},
                                               max_rows=1))
    assert [ex.id for ex in chosen] == ["a"]
    with pytest.raises(DataError, match="all 4 rows were removed"):
        load_examples(openthoughts, _data(filters={"exclude_sources": ["olympiads", "amc_aime", "cn_k12"]}))


@pytest.mark.parametrize("answer, kept", [
    ("34", True), ("-5", True), ("0", True), ("999999", True), (" 8 ", True), ("007", True),
    ("1,000", False), ("+5", False), ("1000000", False), ("3.0", False), ("$34$", False), ("\\boxed{12}", False),
    ("--5", False), ("5-", False), ("\\frac{1}{2}", False), ("   ", False), ("1 000", False),
])
def test_the_integer_answer_regex_is_a_full_match(answer, kept):
    assert bool(select([Example("0", "p", answer)], _data(filters={"answer_regex": r"-?\d{1,6}"}))) is kept


def test_bad_regex_and_fraction_name_the_key():
    with pytest.raises(ConfigError, match="data.filters.answer_regex"):
        _data(filters={"answer_regex": "(-?"})
    with pytest.raises(ConfigError, match="data.filters.top_reference_fraction"):
        _data(filters={"top_reference_fraction": 0.0})


def _synthetic_opsd_table(n: int, seed: int) -> pd.DataFrame:
    """OpenThoughts-style rows: answers of every kind, a few sources (math among them), traces of random length."""
    rng = random.Random(seed)
    answers = ["17", "-42", "123456", "1234567", "1,000", "+5", "3.5", "\\frac{1}{2}", " 88 ", "x=3", "0", "-0"]
    sources = ["math", "olympiads", "cn_k12", "amc_aime", "synthetic_math"]
    words = ["the", "integer", "polynomial", "divides", "hence", "x^2", "=", "\\frac{a}{b}", "we", "get", "42", "so"]
    rows = []
    for i in range(n):
        cot = " ".join(rng.choice(words) for _ in range(rng.randint(0, 120)))
        rows.append({"uuid": f"r{i}", "problem": f"Problem {i}.", "solution": f"Short {i}, \\boxed{{1}}",
                     "COT_Reason": cot, "answer": rng.choice(answers), "source": rng.choice(sources)})
    return pd.DataFrame(rows)


@pytest.mark.parametrize("select_name", ["hard", "nomath"])
def test_opsd_data_selection_reproduces_counts_computed_with_pandas(tmp_path, chat_tok, select_name):
    """The OPSD log's two selections (at a token threshold that fits the synthetic traces) against pandas:
    hard = integer answer and a trace of >= N tokens; nomath = source != math, then the upper half by trace
    length (ties: the earlier row). Then the same through the OPSD_DATA_SELECT switch run.sh maps."""
    df = _synthetic_opsd_table(400, seed=3)
    path = tmp_path / "ot.parquet"
    df.to_parquet(path)
    df["n_tok"] = [len(chat_tok(t, add_special_tokens=False)["input_ids"]) for t in df["COT_Reason"]]
    assert (df["n_tok"] != df["COT_Reason"].str.len()).mean() > 0.9  # tokens, not characters
    threshold = 150
    if select_name == "hard":
        want = df[df["answer"].str.strip().str.fullmatch(r"-?\d{1,6}") & (df["n_tok"] >= threshold)]
        filters = {"answer_regex": r"-?\d{1,6}", "reference": "cot", "min_reference_tokens": threshold}
    else:
        rest = df[df["source"] != "math"]
        want = rest[rest["n_tok"].rank(method="first", ascending=False) <= math.ceil(len(rest) / 2)]
        filters = {"exclude_sources": ["math"], "reference": "cot", "top_reference_fraction": 0.5}
    assert 40 < len(want) < 300  # the filters bite, and leave rows
    got = load_examples(path, _data(filters=filters), tokenizer=chat_tok)
    assert [ex.id for ex in got] == list(want["uuid"])

    from opdkit.recipes import opsd_overrides

    overrides = opsd_overrides({"OPSD_DATA_SELECT": select_name})
    if select_name == "hard":  # the switch's threshold is the seed's 2,000 tokens
        assert config_from_dict({}, overrides).data.filters.min_reference_tokens == 2000
        overrides.append(f"data.filters.min_reference_tokens={threshold}")
    data = config_from_dict({}, overrides).data
    assert [ex.id for ex in load_examples(path, data, tokenizer=chat_tok)] == list(want["uuid"])


def test_token_counter_counts_without_special_tokens(chat_tok):
    count = token_counter(chat_tok)
    assert count([]) == []
    texts = ["<|im_start|>user", "What is"]
    assert count(texts) == [len(chat_tok(t, add_special_tokens=False).input_ids) for t in texts]


def test_reference_solutions_required_for_privileged_teachers(dapo, openthoughts):
    with pytest.raises(DataError, match="min_reference_tokens=1"):
        load_examples(dapo, _data(), require=("solution",))
    assert len(load_examples(openthoughts, _data(), require=("solution",))) == 4
    with pytest.raises(DataError, match="COT_Reason"):  # OPSD_TEACHER_CONTEXT=cot needs the traces
        load_examples(openthoughts, _data(), require=("cot",))


def test_chat_template_encoding(dapo, chat_tok):
    ex = load_examples(dapo, _data())[0]
    cfg = _data(chat_template=True)
    ids = encode_prompt(ex, chat_tok, cfg)
    text = chat_tok.decode(ids)
    assert text.startswith("<|im_start|>user\n" + ANSWER_LINE_PREFIX)
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    enc = chat_tok.apply_chat_template(format_prompt(ex, cfg), add_generation_prompt=True, tokenize=True)
    want = enc["input_ids"] if hasattr(enc, "keys") else enc  # transformers 5: a BatchEncoding
    assert ids == list(want)
    # text prompts become one user message; the privileged prompt carries the reference solution
    t_ex = ex.__class__("t", "What is 2+2?", "4", solution="2+2=4, \\boxed{4}")
    assert chat_tok.decode(encode_prompt(t_ex, chat_tok, _data(prompt_format="boxed", chat_template=True))).startswith(
        "<|im_start|>user\nWhat is 2+2?\n" + BOXED_INSTRUCTION)
    priv = chat_tok.decode(encode_prompt(t_ex, chat_tok, _data(prompt_format="boxed", chat_template=True),
                                         privileged=True))
    assert "2+2=4, \\boxed{4}" in priv and priv.endswith("<|im_start|>assistant\n")
    # no template on the tokenizer: a clear error
    plain = chat_tok.__class__(tokenizer_object=chat_tok.backend_tokenizer, eos_token="<|im_end|>")
    plain.chat_template = None
    with pytest.raises(DataError, match="no chat template"):
        encode_prompt(ex, plain, cfg)
    # without the chat template, chat rows are plain text
    assert chat_tok.decode(encode_prompt(ex, chat_tok,
                                         _data())) == ANSWER_LINE_PREFIX + "What is $3+4$?" + ANSWER_LINE_SUFFIX


def test_embedded_style_privileged_text_prompt_is_unchanged(chat_tok):
    from opdkit.data import Example

    ex = Example("0", "Compute 3+4.", "7", solution="3+4=7")
    assert format_prompt(ex, _data()) == "Compute 3+4."
    assert chat_tok.decode(encode_prompt(ex, chat_tok, _data(), privileged=True)) == "Compute 3+4. [3+4=7]"


def test_bad_rows_name_the_file_and_row(tmp_path):
    bad = _write([{"prompt": [{"role": "user", "content": "hi"}], "reward_model": {"ground_truth": None,
                                                                                   "style": "x"}}],
                 tmp_path / "noanswer.parquet")
    with pytest.raises(DataError, match=r"noanswer.parquet, row 0: no ground-truth answer"):
        load_examples(bad, _data())
    ot = _write([{"problem": "p", "solution": "no box here", "answer": None}], tmp_path / "ot.parquet")
    with pytest.raises(DataError, match=r"row 0: no 'answer' and no \\boxed"):
        load_examples(ot, _data())
    (tmp_path / "x.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="not a readable parquet file"):
        read_table(tmp_path / "x.parquet")
    (tmp_path / "rows.json").write_text(json.dumps([{"prompt": "Compute 1+1.", "answer": 2}]))
    assert load_examples(tmp_path / "rows.json", _data())[0].answer == "2"
    (tmp_path / "rows.jsonl").write_text(json.dumps({"prompt": "Compute 1+1.", "answer": 2.0}) + "\n\n")
    assert load_examples(tmp_path / "rows.jsonl", _data())[0].answer == "2"
    rows = [{"id": "a", "prompt": "Compute 1+1.", "answer": "2"}, {"id": "b", "prompt": " \n", "answer": "3"}]
    (tmp_path / "blank.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"blank.jsonl, row 1 \(id b\): 'prompt' is empty"):
        load_examples(tmp_path / "blank.jsonl", _data())
    chat = _write([{"prompt": [{"role": "user", "content": ""}], "answer": "2"}], tmp_path / "blank_chat.parquet")
    with pytest.raises(DataError, match=r"blank_chat.parquet, row 0 \(id 0\): 'prompt' is empty"):
        load_examples(chat, _data())
    (tmp_path / "weird.jsonl").write_text(json.dumps({"query": "?"}) + "\n")
    with pytest.raises(DataError, match="expected a 'prompt' column"):
        load_examples(tmp_path / "weird.jsonl", _data())


# --- the public benchmark files' shapes (no data is shipped: rows written here in their columns) ------------


def test_math500_aime_and_openthoughts_shapes(tmp_path):
    math500 = _write([{"problem": "Find $x$.", "solution": "So $x=\\boxed{\\frac{1}{2}}$.", "answer": "\\frac{1}{2}",
                       "subject": "Algebra", "level": 3, "unique_id": "test/algebra/1.json"}],
                     tmp_path / "math500.parquet")
    aime24 = _write([{"ID": "2024-I-1", "Problem": "Every morning Aya ...", "Solution": "... $\\boxed{204}$",
                      "Answer": 204},
                     {"ID": "2024-I-2", "Problem": "There exist real numbers ...", "Solution": "...", "Answer": 25}],
                    tmp_path / "aime_2024.parquet")
    aime25_oc = tmp_path / "aime2025-I.jsonl"  # opencompass/AIME2025
    aime25_oc.write_text(json.dumps({"question": "Find the sum of all integer bases ...", "answer": "70"}) + "\n")
    aime25_yl = _write([{"id": 0, "problem": "Find the sum ...", "solution": "", "answer": "70", "url": "u",
                         "year": 2025}],
                       tmp_path / "aime_2025.parquet")
    opsd = _write([{"problem": "p", "solution": "s \\boxed{3}", "COT_Reason": "a long trace", "answer": "3",
                    "source": "olympiads"}], tmp_path / "opsd.parquet")
    (ex,) = load_examples(math500, _data())
    assert (ex.id, ex.prompt, ex.answer, ex.source) == ("test/algebra/1.json", "Find $x$.", "\\frac{1}{2}", "")
    a, b = load_examples(aime24, _data())
    assert (a.id, a.prompt, a.answer, b.answer) == ("2024-I-1", "Every morning Aya ...", "204", "25")
    (c,) = load_examples(aime25_oc, _data())
    assert (c.id, c.prompt, c.answer) == ("0", "Find the sum of all integer bases ...", "70")
    (d,) = load_examples(aime25_yl, _data())
    assert (d.id, d.answer, d.source) == ("0", "70", "2025")  # the year column is the source
    (e,) = load_examples(opsd, _data())
    assert (e.solution, e.cot, e.source) == ("s \\boxed{3}", "a long trace", "olympiads")


def test_eval_files_keep_their_questions_apart_and_name_their_parts(tmp_path):
    from opdkit.data import load_eval_examples

    a = tmp_path / "aime_2024.jsonl"
    a.write_text("".join(json.dumps({"question": f"q{i}", "answer": str(i)}) + "\n" for i in range(3)))
    b = tmp_path / "aime_2025.jsonl"
    b.write_text("".join(json.dumps({"question": f"r{i}", "answer": str(i)}) + "\n" for i in range(2)))
    assert [ex.id for ex in load_eval_examples([a])] == ["0", "1", "2"]  # one file: as it is
    both = load_eval_examples([a, b])
    assert [ex.id for ex in both] == ["aime_2024/0", "aime_2024/1", "aime_2024/2", "aime_2025/0", "aime_2025/1"]
    assert [ex.source for ex in both] == ["aime_2024"] * 3 + ["aime_2025"] * 2
    # evaluation reads every row: training filters do not apply
    f = tmp_path / "f.jsonl"
    f.write_text(json.dumps({"question": "q", "answer": "1,000"}) + "\n")
    assert len(load_eval_examples([f])) == 1


# the released OPSD collator's and evaluator's messages, as their f-strings write them
# (siyan-zhao/OPSD data_collator.py and eval/evaluate_math.py at the release)
def _released_student(problem):
    return f"Problem: {problem}\n\nPlease reason step by step, and put your final answer within \\boxed{{}}."


def _released_teacher(problem, solution):
    transition_prompt = ("\n\nAfter understanding the reference solution and the rationale behind each step, now "
                         "articulate your own step-by-step reasoning that derives the same final answer to the problem "
                         "below:\n")
    return (f"{problem}\n\n"
            f"Here is a reference solution to this problem:\n{solution}\n"
            f"{transition_prompt}\n"
            f"Please reason step by step, and put your final answer within \\boxed{{}}.")


def _released_eval(problem):
    return f"{problem}\n\nPlease reason step by step, and put your final answer within \\boxed{{}}."


def test_opsd_prompts_are_the_released_ones_byte_for_byte():
    from opdkit.data import privileged_prompt

    ex = Example("0", "Let $f(x)={x}^2$; find {problem}.", "4", solution="Since {reference} \\boxed{4}",
                 cot="<think>a trace {x}</think>")
    student = format_prompt(ex, _data(prompt_format="opsd_student", chat_template=True))
    assert student == [{"role": "user", "content": _released_student(ex.prompt)}]
    assert format_prompt(ex, _data(prompt_format="opsd_eval")) == _released_eval(ex.prompt)
    for context, ref in (("solution", ex.solution), ("cot", ex.cot), ("both", ex.solution + "\n\n" + ex.cot)):
        data = _data(prompt_format="opsd_student", chat_template=True, teacher_prompt="opsd", teacher_context=context)
        assert privileged_prompt(ex, data) == [{"role": "user", "content": _released_teacher(ex.prompt, ref)}]
    # the student's switch to the eval prompt leaves the teacher's message as it was
    data = _data(prompt_format="opsd_eval", chat_template=True, teacher_prompt="opsd")
    assert privileged_prompt(ex, data) == [{"role": "user", "content": _released_teacher(ex.prompt, ex.solution)}]
