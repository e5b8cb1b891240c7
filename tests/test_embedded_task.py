from opdkit.embedded import task
from opdkit.embedded.tokenizer import build_tokenizer


def test_carry_dropping_by_hand():
    assert task.add_without_carry(47, 5) == 42
    assert task.add_without_carry(58, 67) == 15
    assert task.add_without_carry(12, 34) == 46
    p = task.Problem(47, (("+", 5), ("-", 29)))
    assert p.prompt == "Compute 47+5-29."
    assert task.solve(p) == (" 47+5=52. 52-29=23. \\boxed{23}", 23)
    assert task.carry_dropped_solution(p) == " 47+5=42. 42-29=13. \\boxed{13}"
    assert task.parse_prompt(p.prompt) == p


def test_splits_are_seeded_disjoint_and_in_range():
    a_train, a_eval = task.make_splits(3, 500, 100)
    b_train, b_eval = task.make_splits(3, 500, 100)
    assert a_train == b_train and a_eval == b_eval
    assert task.make_splits(4, 500, 100)[0] != a_train
    assert not {r["prompt"] for r in a_train} & {r["prompt"] for r in a_eval}
    for r in a_train + a_eval:
        p = task.parse_prompt(r["prompt"])
        assert r["solution"].endswith(f"\\boxed{{{r['answer']}}}")
        v = p.first
        for op, x in p.ops:
            v = v + x if op == "+" else v - x
            assert 0 <= v <= 99
        assert str(v) == r["answer"]


def test_tokenizer_is_character_level_and_roundtrips(tmp_path):
    tok = build_tokenizer()
    text = "Compute 47+5-29. 47+5=52. 52-29=23. \\boxed{23}"
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id and len(ids) == len(text) + 1
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.unk_token_id not in ids
    tok.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again(text).input_ids == ids and again.pad_token_id == tok.pad_token_id
