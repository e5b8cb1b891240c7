"""Real data formats (DAPO-Math chat rows, OpenThoughts problem/solution/answer rows) from parquet
files written here, selection filters, prompt formats and chat templates."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from opdkit.config import config_from_dict
from opdkit.data import (ANSWER_LINE_PREFIX, ANSWER_LINE_SUFFIX, BOXED_INSTRUCTION, DataError, encode_prompt,
                         format_prompt, is_integer_answer, load_examples, read_table)

DAPO_PROBLEMS = [("What is $3+4$?", "7"), ("Find $x$ if $2x=1$.", "\\frac{1}{2}"), ("How many primes are below 20?", "8")]


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
        {"uuid": "a", "problem": "Compute 12*12.", "solution": "12*12 = 144, so \\boxed{144}.", "answer": "144", "source": "olympiads"},
        {"uuid": "b", "problem": "Compute 1/4+1/4.", "solution": "Half: \\boxed{\\frac{1}{2}}", "answer": None, "source": "amc_aime"},
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
    corpus = [q for q, _ in DAPO_PROBLEMS] + [ANSWER_LINE_PREFIX, ANSWER_LINE_SUFFIX, BOXED_INSTRUCTION, "user assistant"]
    tk.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|im_start|>", "<|im_end|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|im_end|>")
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
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
    assert format_prompt(exs[1], _data(prompt_format="raw")) == ANSWER_LINE_PREFIX + "Find $x$ if $2x=1$." + ANSWER_LINE_SUFFIX


def test_openthoughts_rows_and_filters(openthoughts):
    exs = load_examples(openthoughts, _data())
    assert [ex.id for ex in exs] == ["a", "b", "c", "d"]
    assert [ex.answer for ex in exs] == ["144", "\\frac{1}{2}", "10", "1,000"]  # missing answers from the last \boxed{}
    assert [ex.id for ex in load_examples(openthoughts, _data(filters={"integer_answers": True}))] == ["a", "c", "d"]
    assert [ex.id for ex in load_examples(openthoughts, _data(filters={"min_solution_chars": 20}))] == ["a", "b", "d"]
    assert [ex.id for ex in load_examples(openthoughts, _data(filters={"exclude_sources": ["cn_k12", "amc_aime"]}))] == ["a", "d"]
    chosen = load_examples(openthoughts, _data(filters={"integer_answers": True, "min_solution_chars": 20,
                                                         "exclude_sources": ["cn_k12"]}, max_rows=1))
    assert [ex.id for ex in chosen] == ["a"]
    with pytest.raises(DataError, match="all 4 rows were removed"):
        load_examples(openthoughts, _data(filters={"exclude_sources": ["olympiads", "amc_aime", "cn_k12"]}))


def test_integer_answers():
    for a in ["34", "-5", "+7", "1,000", "1{,}000", "$34$", "\\boxed{12}", " 8 "]:
        assert is_integer_answer(a), a
    for a in ["3.5", "\\frac{1}{2}", "x=3", "", "2\\sqrt{2}", "34.0"]:
        assert not is_integer_answer(a), a


def test_reference_solutions_required_for_privileged_teachers(dapo, openthoughts):
    with pytest.raises(DataError, match="min_solution_chars=1"):
        load_examples(dapo, _data(), require_solution=True)
    assert len(load_examples(openthoughts, _data(), require_solution=True)) == 4


def test_chat_template_encoding(dapo, chat_tok):
    ex = load_examples(dapo, _data())[0]
    cfg = _data(chat_template=True)
    ids = encode_prompt(ex, chat_tok, cfg)
    text = chat_tok.decode(ids)
    assert text.startswith("<|im_start|>user\n" + ANSWER_LINE_PREFIX) and text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    enc = chat_tok.apply_chat_template(format_prompt(ex, cfg), add_generation_prompt=True, tokenize=True)
    want = enc["input_ids"] if hasattr(enc, "keys") else enc  # transformers 5: a BatchEncoding
    assert ids == list(want)
    # text prompts become one user message; the privileged prompt carries the reference solution
    t_ex = ex.__class__("t", "What is 2+2?", "4", solution="2+2=4, \\boxed{4}")
    assert chat_tok.decode(encode_prompt(t_ex, chat_tok, _data(prompt_format="boxed", chat_template=True))).startswith(
        "<|im_start|>user\nWhat is 2+2?\n" + BOXED_INSTRUCTION)
    priv = chat_tok.decode(encode_prompt(t_ex, chat_tok, _data(prompt_format="boxed", chat_template=True), privileged=True))
    assert "2+2=4, \\boxed{4}" in priv and priv.endswith("<|im_start|>assistant\n")
    # no template on the tokenizer: a clear error
    plain = chat_tok.__class__(tokenizer_object=chat_tok.backend_tokenizer, eos_token="<|im_end|>")
    plain.chat_template = None
    with pytest.raises(DataError, match="no chat template"):
        encode_prompt(ex, plain, cfg)
    # without the chat template, chat rows are plain text
    assert chat_tok.decode(encode_prompt(ex, chat_tok, _data())) == ANSWER_LINE_PREFIX + "What is $3+4$?" + ANSWER_LINE_SUFFIX


def test_embedded_style_privileged_text_prompt_is_unchanged(chat_tok):
    from opdkit.data import Example

    ex = Example("0", "Compute 3+4.", "7", solution="3+4=7")
    assert format_prompt(ex, _data()) == "Compute 3+4."
    assert chat_tok.decode(encode_prompt(ex, chat_tok, _data(), privileged=True)) == "Compute 3+4. [3+4=7]"


def test_bad_rows_name_the_file_and_row(tmp_path):
    bad = _write([{"prompt": [{"role": "user", "content": "hi"}], "reward_model": {"ground_truth": None, "style": "x"}}],
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
    (tmp_path / "weird.jsonl").write_text(json.dumps({"question": "?"}) + "\n")
    with pytest.raises(DataError, match="expected a 'prompt' column"):
        load_examples(tmp_path / "weird.jsonl", _data())
