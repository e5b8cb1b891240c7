"""Cross-tokenizer OPD (teacher.tokenizer=own; opdkit.xtok, opdkit.xtok_loss).

- alignment edge cases on hand-made ends and real tokenizers: a student token over several teacher
  tokens and the reverse, characters split over byte-level tokens (zero-width tokens), special
  tokens, EOS, truncated and empty completions, a normalising teacher (respelled rows);
- span log-probs against an independent computation: the teacher scored alone on its own
  tokenization of the row (unbatched, unpadded), each span's characters found through the
  tokenizer's offsets, not the payload tables;
- the span estimators' gradients by autograd; the vocabulary projection against enumeration;
- one tokenizer on both sides (own forced): every loss's value and gradient equal the shared path's
  exactly;
- refused params, the loss table's cross-tokenizer lines, the embedded BPE teacher's cache.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from tokenizers import Tokenizer, models, normalizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from opdkit import loss_table, losses, opd, step as opd_step, xtok, xtok_loss
from opdkit.config import Config, replace
from opdkit.embedded import task
from opdkit.embedded.bpe_teacher import build_bpe_tokenizer
from opdkit.embedded.tokenizer import build_tokenizer
from opdkit.engines.base import Rollout, left_pad
from opdkit.scores import TeacherScores

CHAR_EOS = 2  # <eos> in the character-level and the BPE tokenizers


@pytest.fixture(scope="module")
def rows():
    return task.make_splits(0, 400, 8, 3, 3)[0]


@pytest.fixture(scope="module")
def bpe(rows):
    return build_bpe_tokenizer([r["prompt"] + r["solution"] for r in rows], 320)


@pytest.fixture(scope="module")
def char():
    return build_tokenizer()


def pair_of(s_tok, t_tok, s_eos=(CHAR_EOS,), t_stop=(CHAR_EOS,), t_end=CHAR_EOS):
    return xtok.make_pair(s_tok, t_tok, s_eos, t_stop, t_end)


def tiny_llama(tok, seed):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.5)  # a few nats of entropy: log-probs far from uniform
    return model


# --- alignment ------------------------------------------------------------------------------------------------


def test_spans_are_the_minimal_groups_covering_the_same_characters():
    # "abcdef": student a|bc|d|ef, teacher ab|c|de|f -> spans "abc" (2:2) and "def" (2:2)
    assert xtok.align_spans([1, 3, 4, 6], [2, 3, 5, 6]) == ([0, 0, 1, 1], [0, 0, 1, 1], 2)
    # a student token over three teacher tokens, then one-to-one, then three student tokens over one teacher token
    assert xtok.align_spans([3, 4, 5, 6, 7], [1, 2, 3, 4, 7]) == ([0, 1, 2, 2, 2], [0, 0, 0, 1, 2], 3)
    # zero-width tokens (the first bytes of a character) join the span of the token that completes it
    assert xtok.align_spans([1, 1, 1, 2], [1, 2]) == ([0, 1, 1, 1], [0, 1], 2)
    assert xtok.align_spans([1, 2, 2], [2]) == ([0, 0, 0], [0], 1)  # trailing zero-width: the last span
    assert xtok.align_spans([], []) == ([], [], 0)
    with pytest.raises(ValueError, match="spell 3 and 2 characters"):
        xtok.align_spans([3], [2])


def test_char_ends_decode_utf8_incrementally():
    ni = "你".encode()
    assert xtok.char_ends([b"a", ni[:1], ni[1:2], ni[2:], b"b"]) == ("a你b", [1, 1, 1, 2, 3])
    assert xtok.char_ends([b"a", ni[:2]]) == ("a\ufffd", [1, 2])  # a truncated character: U+FFFD on the last token
    assert xtok.char_ends([]) == ("", [])


def test_payloads_spell_the_text_of_byte_level_and_character_tokenizers(bpe, char):
    text = " 47+5=52. \\boxed{31}"
    for tok in (bpe, char):
        ids = tok(text, add_special_tokens=False).input_ids
        assert xtok.char_ends([xtok.token_bytes(tok)[i] for i in ids])[0] == text
    b = xtok.token_bytes(bpe)
    assert b[bpe.convert_tokens_to_ids("Ġ4")] == b" 4" and b[CHAR_EOS] == b"<eos>"


def stable_cuts(text: str, s_offsets, t_offsets, s_tok, t_tok) -> tuple[list[int], bool]:
    """The closing rule written out on each tokenizer's own decoding of its vocabulary (ASCII text:
    characters are bytes): the offsets, in order, where both tokenizations end and the open span may
    close (no teacher token starts with a suffix of the span's text and goes on with a character that no
    student token from the same suffix, inside the student's last token, has next), the text's end
    included; and whether the end may close before an EOS."""
    def texts(tok):
        added = set(tok.added_tokens_decoder)
        return [tok.convert_tokens_to_string([t]) for t, i in tok.get_vocab().items() if i not in added]

    T, S = texts(t_tok), texts(s_tok)

    def nxt(vocab, sigma):
        return {x[len(sigma)] for x in vocab if len(x) > len(sigma) and x.startswith(sigma)}

    s_start, t_start = {e: a for a, e in s_offsets}, {e: a for a, e in t_offsets}

    def ok(span, v):
        return all(nxt(T, span[-n:]) <= (nxt(S, span[-n:]) if v.endswith(span[-n:]) else set())
                   for n in range(1, len(span) + 1))

    cuts, last, end_ok = [], 0, True
    for b in sorted(set(s_start) & set(t_start)):
        closes = ok(text[last:b], text[s_start[b]:b])
        if b == len(text):
            end_ok = closes
        if closes or b == len(text):
            cuts.append(b)
            last = b
    return cuts, end_ok


def test_rows_align_across_a_character_and_a_byte_level_bpe_tokenizer(char, bpe, rows):
    pair = pair_of(char, bpe)
    for text in (rows[0]["solution"], rows[1]["solution"], " 93+5=98. 98-9=89."):
        s = char(text, add_special_tokens=False).input_ids
        full, trunc = xtok.align_rows(pair, [s + [CHAR_EOS], s[:7]])
        want = bpe(text, add_special_tokens=False, return_offsets_mapping=True)
        assert full.t_ids == want.input_ids + [CHAR_EOS] and not full.respelled
        # each character's span: the interval between the closing offsets that holds it
        cuts, eos_apart = stable_cuts(text, [(i, i + 1) for i in range(len(text))], want.offset_mapping, char, bpe)
        span_of = lambda a, z, cuts=cuts: next(j for j, c in enumerate(cuts) if c >= z)  # noqa: E731
        assert full.s_span[:-1] == [span_of(i, i + 1) for i in range(len(text))]
        assert full.t_span[:-1] == [span_of(a, z) for a, z in want.offset_mapping]
        assert full.s_span[-1] == full.t_span[-1] == (len(cuts) if eos_apart else len(cuts) - 1)
        assert full.n_spans == full.s_span[-1] + 1 < len(text)  # the BPE merges characters: fewer spans
        assert trunc.t_ids == bpe(text[:7], add_special_tokens=False).input_ids and CHAR_EOS not in trunc.t_ids
    (empty, nothing) = xtok.align_rows(pair, [[CHAR_EOS], []])
    assert (empty.t_ids, empty.s_span, empty.t_span, empty.n_spans) == ([CHAR_EOS], [0], [0], 1)
    assert (nothing.t_ids, nothing.n_spans) == ([], 0)


def test_a_span_stays_open_where_the_teachers_token_depends_on_the_next_character(char, bpe):
    """" 98." : the teacher writes " 98" as one token and "9" could have gone on ("98", "93" are its
    tokens) while the student's "9" cannot: the span holding "9" stays open until the teacher's token
    cannot change with what follows. With one tokenizer every common boundary closes."""
    pair = pair_of(char, bpe)
    assert not pair.closes(b"9", char.convert_tokens_to_ids("9")) and pair.closes(b"+", char.convert_tokens_to_ids("+"))
    assert not pair.closes(b" 9", char.convert_tokens_to_ids("9"))  # " 93" starts with " 9"
    (a,) = xtok.align_rows(pair, [char(" 98.", add_special_tokens=False).input_ids + [CHAR_EOS]])
    assert a.t_ids[:-1] == bpe(" 98.", add_special_tokens=False).input_ids and a.s_span == [0, 0, 0, 0, 1]
    same = pair_of(bpe, bpe)
    assert all(same.closes(b, i) for i, b in enumerate(same.t_bytes) if i not in same.t_added)


def test_the_teacher_view_lays_spans_out_per_token(char, bpe):
    pair = pair_of(char, bpe)
    comp = [char(" 47+5=52.", add_special_tokens=False).input_ids + [CHAR_EOS], [CHAR_EOS]]
    T = max(map(len, comp))
    ids_B_T = torch.zeros((2, T), dtype=torch.long)
    mask_B_T = torch.zeros((2, T))
    for b, c in enumerate(comp):
        ids_B_T[b, :len(c)], mask_B_T[b, :len(c)] = torch.tensor(c), 1
    xb = xtok.teacher_view(pair, ids_B_T, mask_B_T, [[1, 5], [1]])
    t = bpe.convert_ids_to_tokens(xb.teacher.completion_ids_B_T[0, :int(xb.teacher.completion_mask_B_T[0].sum())])
    assert t[-1] == "<eos>" and "".join(t[:-1]).replace("Ġ", " ") == " 47+5=52."
    n0 = len(comp[0])
    lens = xb.s_len_B_T[0, :n0].tolist()
    for i in range(n0):  # a one-to-one token's teacher column holds the teacher token of its span
        span = int(xb.s_span_B_T[0, i])
        t_cols = (xb.t_span_B_U[0] == span).nonzero()[:, 0].tolist()
        assert lens[i] == int((xb.s_span_B_T[0] == span).sum())
        assert bool(xb.one_B_T[0, i]) == (lens[i] == 1 and len(t_cols) == 1)
        if xb.one_B_T[0, i]:
            assert int(xb.t_pos_B_T[0, i]) == t_cols[0]
    assert xb.s_span_B_T[1].tolist()[:2] == [0, -1] and bool(xb.one_B_T[1, 0])
    assert torch.equal(xb.teacher.prompt_mask_B_Sp, torch.tensor([[1, 1], [0, 1]]))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    from opdkit.models import load_tokenizer
    from qwen2_fixture import fixture_dir

    return load_tokenizer(fixture_dir(tmp_path_factory) / "student")


def test_byte_level_splits_special_tokens_and_eos_across_two_real_tokenizers(qwen, char):
    """The Qwen2.5 tokenizer (byte-level BPE) as the student, sampling a character byte by byte (a
    non-canonical tokenization) and a special token; its EOS <|im_end|> against the character-level
    teacher's <eos>; and the reverse."""
    pay = xtok.token_bytes(qwen)
    by_bytes = {b: i for i, b in reversed(list(enumerate(pay)))}
    ni = "你".encode()
    # Hi 你 <|im_start|> <|im_end|>
    s = [by_bytes[b"Hi"], by_bytes[ni[:1]], by_bytes[ni[1:2]], by_bytes[ni[2:]], 151644, 151645]
    same = xtok.make_pair(qwen, qwen, (151645, 151643), (151645, 151643), 151645)
    (a,) = xtok.align_rows(same, [s])
    assert a.t_ids == [by_bytes[b"Hi"], qwen.convert_tokens_to_ids("ä½ł"), 151644, 151645] and not a.respelled
    # the student's bytes of 你 against the teacher's token: a span; and it stays open, since the teacher's
    # 你 could have gone on (its 你好) where the student's last byte cannot: the next token closes it
    assert a.s_span == [0, 1, 1, 1, 1, 2] and a.t_span == [0, 1, 1, 2]
    # the character-level teacher has no "你": its <unk> does not spell the text, so the row is one span
    cross = xtok.make_pair(qwen, char, (151645, 151643), (CHAR_EOS,), CHAR_EOS)
    (b,) = xtok.align_rows(cross, [s])
    assert b.respelled and b.t_ids[-1] == CHAR_EOS and b.n_spans == 2 and b.s_span == [0] * 5 + [1]
    (c,) = xtok.align_rows(cross, [[by_bytes[b" +"], by_bytes[b"7"], 151643]])  # <|endoftext|> ends it too
    assert not c.respelled and c.t_ids == char(" +7", add_special_tokens=False).input_ids + [CHAR_EOS]
    assert (c.s_span, c.t_span) == ([0, 1, 2], [0, 0, 1, 2])
    back = xtok.make_pair(char, qwen, (CHAR_EOS,), (151645, 151643), 151645)
    (d,) = xtok.align_rows(back, [char("7 +", add_special_tokens=False).input_ids + [CHAR_EOS]])
    # Qwen's digits never merge ("7" closes); its " +" could go on (" +=") where the student's "+" cannot, so
    # the EOS, which decides that it does not, joins that span
    assert d.t_ids == [by_bytes[b"7"], by_bytes[b" +"], 151645] and d.s_span == [0, 1, 1, 1] and d.n_spans == 2


def test_a_normalising_teacher_tokenizer_respells_and_the_row_is_one_span(char):
    vocab = {t: i for i, t in enumerate(["<pad>", "<bos>", "<eos>", "<unk>", *"abcdefgh ", "A"])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.normalizer = normalizers.Lowercase()
    low = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    upper = build_tokenizer(chars="abcdefghABC ")
    pair = xtok.make_pair(upper, low, (CHAR_EOS,), (CHAR_EOS,), CHAR_EOS)
    fine, respelled = xtok.align_rows(pair, [upper("bad", add_special_tokens=False).input_ids + [CHAR_EOS],
                                             upper("Bad", add_special_tokens=False).input_ids + [CHAR_EOS]])
    assert not fine.respelled and fine.s_span == [0, 1, 2, 3]
    assert respelled.respelled and respelled.s_span == [0, 0, 0, 1] and respelled.t_span == [0, 0, 0, 1]


# --- span log-probs against an independent computation -------------------------------------------------------


def _rollout(s_tok, texts: list[str], prompts: list[list[int]], ended: list[bool]):
    comps = [s_tok(t, add_special_tokens=False).input_ids + ([CHAR_EOS] if e else []) for t, e in zip(texts, ended)]
    T = max(map(len, comps))
    ids_B_T, mask_B_T = torch.zeros((len(comps), T), dtype=torch.long), torch.zeros((len(comps), T))
    for b, c in enumerate(comps):
        ids_B_T[b, :len(c)], mask_B_T[b, :len(c)] = torch.tensor(c), 1
    p_B_S, pm_B_S = left_pad(prompts, s_tok.pad_token_id)
    B = len(comps)
    return Rollout(p_B_S, pm_B_S, ids_B_T, mask_B_T, torch.zeros((B, T)), torch.tensor([not e for e in ended]),
                   torch.arange(B))


def _alone(model, ids: list[int]) -> list[float]:
    """log p of each token of ``ids`` after the first, the sequence scored alone (no padding, no batch)."""
    with torch.no_grad():
        logp_S_V = model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return [float(logp_S_V[i - 1, ids[i]]) for i in range(1, len(ids))]


@pytest.mark.parametrize("direction", ["char student, bpe teacher", "bpe student, char teacher"])
def test_span_logprobs_equal_each_models_own_logprob_of_the_spans_text(direction, char, bpe, rows):
    s_tok, t_tok = (char, bpe) if direction.startswith("char") else (bpe, char)
    student, teacher = tiny_llama(s_tok, 0), tiny_llama(t_tok, 1)
    texts = [rows[i]["solution"] for i in range(3)] + [rows[3]["solution"][:11]]
    ended = [True, True, True, False]
    s_prompts = [s_tok(r["prompt"]).input_ids for r in rows[:4]]
    t_prompts = [t_tok(r["prompt"]).input_ids for r in rows[:4]]
    ro = _rollout(s_tok, texts, s_prompts, ended)
    batch = opd.Batch(ro, ro.prompt_ids_B_Sp, ro.prompt_mask_B_Sp)
    batch.xtok = xtok.teacher_view(pair_of(s_tok, t_tok), ro.completion_ids_B_T, ro.completion_mask_B_T, t_prompts)
    cfg = replace(Config(), "loss.name=k1", "optim.micro_batch=3", "teacher.tokenizer=own")
    ctxs = opd_step.score_batch(cfg.loss, teacher, batch, contextlib.nullcontext, rollout=cfg.rollout,
                                runtime=cfg.runtime, micro_batch=cfg.optim.micro_batch)
    got_B_T = torch.cat([c.logp_B_T for c in ctxs])
    head = student.lm_head
    rest_B_T = []  # t~ after the student's rest of each span (with_student_rest), per micro-batch
    for c, rows_ in zip(ctxs, opd_step.micro_slices(batch, cfg.optim.micro_batch)):
        g = opd.student_geometry(batch, rows_)
        with torch.no_grad():
            h = student.model(input_ids=g.input_ids_B_S, attention_mask=g.attention_mask_B_S,
                              position_ids=g.position_ids_B_S).last_hidden_state[:, g.prompt_width - 1:-1]
        rest_B_T.append(xtok_loss.with_student_rest(c, head, h, ro.completion_ids_B_T[rows_], 64, 1.0, 1.0).logp_B_T)
    rest_B_T = torch.cat(rest_B_T)
    for b, (text, e) in enumerate(zip(texts, ended)):
        # independently: each model alone on its own tokenization, characters from the tokenizers' offsets
        s_enc, t_enc = (tok(text, add_special_tokens=False, return_offsets_mapping=True) for tok in (s_tok, t_tok))
        t_lp = _alone(teacher, t_prompts[b] + t_enc.input_ids + [CHAR_EOS])[len(t_prompts[b]) - 1:]
        s_lp = _alone(student, s_prompts[b] + s_enc.input_ids + [CHAR_EOS])[len(s_prompts[b]) - 1:]
        cuts, eos_apart = stable_cuts(text, s_enc.offset_mapping, t_enc.offset_mapping, s_tok, t_tok)
        n, u = len(s_enc.input_ids), len(t_enc.input_ids)
        eos_in_last = e and not eos_apart  # the last span stays open: the EOS closes it
        for i, (a, z) in enumerate(s_enc.offset_mapping):
            lo, hi = max([0] + [c_ for c_ in cuts if c_ <= a]), min(c_ for c_ in cuts if c_ >= z)
            end = eos_in_last and hi == len(text)
            T_span = sum(lp for (ta, tz), lp in zip(t_enc.offset_mapping, t_lp) if lo <= ta and tz <= hi)
            T_span += t_lp[u] if end else 0.0
            S_rest = sum(lp for k, ((sa, sz), lp) in enumerate(zip(s_enc.offset_mapping, s_lp))
                         if lo <= sa and sz <= hi and k != i) + (s_lp[n] if end else 0.0)
            assert got_B_T[b, i].item() == pytest.approx(T_span, abs=1e-4), (direction, b, i)
            assert rest_B_T[b, i].item() == pytest.approx(T_span - S_rest, abs=1e-4), (direction, b, i)
        if e:  # the EOS: the teacher's log-prob of its end token after the whole text (and the open last span's)
            lo = max([0] + [c_ for c_ in cuts if c_ < len(text)]) if eos_in_last else len(text)
            T_eos = t_lp[u] + sum(lp for (ta, _), lp in zip(t_enc.offset_mapping, t_lp) if ta >= lo)
            assert got_B_T[b, n].item() == pytest.approx(T_eos, abs=1e-4)
        assert not bool(ro.completion_mask_B_T[b, n + int(e):].any())
        if direction.startswith("char"):
            assert len(cuts) < n  # characters did merge into spans


# --- the span estimators' gradients and the vocabulary projection -----------------------------------------------


@pytest.mark.parametrize("loss", ["k1", "k2", "k3"])
def test_every_token_of_a_span_gets_the_span_estimators_gradient(loss):
    """One row: spans {0,1,2} (three student tokens), {3} and {4,5}; teacher span log-probs T_j. The
    chunk loss on (s, t~) has d loss / d s_i = g(S_j - T_j) / n for every token i of span j, where g
    is the estimator's: k1 -(T - S), k2 (S - T), k3 1 - exp(T - S)."""
    s_1_T = torch.tensor([[-0.3, -1.2, -0.5, -2.0, -0.1, -0.7]], dtype=torch.float64, requires_grad=True)
    span_1_T = torch.tensor([[0, 0, 0, 1, 2, 2]])
    len_1_T = torch.tensor([[3.0, 3, 3, 1, 2, 2]])
    T_J = torch.tensor([-1.5, -2.5, -0.2], dtype=torch.float64)
    S_J = xtok.span_sum(s_1_T.detach(), span_1_T, 3)[0]
    ctx = TeacherScores(T_J[span_1_T], xtok_span_B_T=span_1_T, xtok_len_B_T=len_1_T, xtok_span_logp_B_T=T_J[span_1_T])
    head = torch.nn.Identity()  # h are the logits: token_logprobs gives back s (a 2-id vocabulary per position)
    z_1_T_2 = torch.stack([s_1_T.detach(), torch.log1p(-s_1_T.detach().exp())], -1)
    ids_1_T = torch.zeros((1, 6), dtype=torch.long)
    t_1_T = xtok_loss.with_student_rest(ctx, head, z_1_T_2.float(), ids_1_T, 8, 1.0, 1.0).logp_B_T.double()
    mask = torch.ones((1, 6))
    fn = getattr(losses, f"{loss}_loss")
    args = (s_1_T, s_1_T.detach(), t_1_T, mask, 6.0) + ((0.2,) if loss == "k1" else ())
    fn(*args)[0].backward()
    d_J = (S_J - T_J)
    g_J = {"k1": d_J, "k2": d_J, "k3": 1 - torch.exp(-d_J)}[loss]
    torch.testing.assert_close(s_1_T.grad[0], g_J[span_1_T[0]] / 6, rtol=1e-5, atol=1e-6)


def test_the_vocabulary_projection_by_enumeration():
    """Student: characters a b c; teacher: a b c d, ab, bc (merges). prefix: ab -> a, bc -> b, d -> the
    tail (the student spells it <unk>); exact: only a, b, c map. Bucket log-probs and the rkl over
    them against sums written out."""
    s_tok = build_tokenizer(chars="abc")
    vocab = {t: i for i, t in enumerate(["<pad>", "<bos>", "<eos>", "<unk>", "a", "b", "c", "d", "ab", "bc"])}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b"), ("b", "c")], unk_token="<unk>"))
    t_tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    pair = xtok.make_pair(s_tok, t_tok, (CHAR_EOS,), (CHAR_EOS,), CHAR_EOS)
    sv = s_tok.get_vocab()
    want = {"prefix": {vocab["ab"]: sv["a"], vocab["bc"]: sv["b"], vocab["d"]: -1},
            "exact": {vocab["ab"]: -1, vocab["bc"]: -1, vocab["d"]: -1}}
    torch.manual_seed(0)
    s_logits = torch.randn(2, 3, len(pair.s_bytes), requires_grad=True)
    t_logp = torch.randn(2, 3, len(pair.t_bytes)).log_softmax(-1)
    for mode, special in want.items():
        m, _ = xtok_loss.vocab_map(pair, mode)
        for t_id, s_id in special.items():
            assert m[t_id] == s_id, (mode, t_id)
        for name in ("<pad>", "<bos>", "<eos>", "<unk>", "a", "b", "c"):
            assert m[vocab[name]] == sv[name]
        proj = xtok_loss.make_projection(pair, mode)
        s_q, t_q = xtok_loss.project(s_logits, t_logp, proj)
        image = sorted({s for s in m if s >= 0})
        assert proj.image_K.tolist() == image and not proj.identity
        p_S, p_T = s_logits.detach().softmax(-1), t_logp.exp()
        for k, s_id in enumerate(image + [None]):
            teacher_ids = [t for t, s in enumerate(m) if (s == s_id if s_id is not None else s < 0)]
            student_ids = [s_id] if s_id is not None else [v for v in range(len(pair.s_bytes)) if v not in image]
            torch.testing.assert_close(t_q[..., k].exp(), p_T[..., teacher_ids].sum(-1), rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(s_q[..., k].detach().exp(), p_S[..., student_ids].sum(-1), rtol=1e-5, atol=1e-7)
        loss, m_ = losses.rkl_loss(s_q, t_q, torch.ones(2, 3), 6.0)
        q_S, q_T = s_q.detach().exp(), t_q.exp()
        terms = torch.where(q_S > 0, q_S * (q_S.log() - q_T.log()), torch.zeros_like(q_S))  # 0 log 0 = 0
        assert loss.item() == pytest.approx(float(terms.sum() / 6), rel=1e-5)
    ident = xtok_loss.make_projection(xtok.make_pair(s_tok, s_tok, (CHAR_EOS,), (CHAR_EOS,), CHAR_EOS), "prefix")
    assert ident.identity and ident.tail_empty and ident.mapped_frac == 1.0


def test_an_empty_tail_stays_minus_infinity_and_gives_no_nan_gradient():
    s_tok = build_tokenizer(chars="ab")
    pair = xtok.make_pair(s_tok, s_tok, (CHAR_EOS,), (CHAR_EOS,), CHAR_EOS)
    proj = xtok_loss.make_projection(pair, "prefix")
    keep = torch.arange(len(pair.s_bytes)) != 5  # not the identity: one student id receives nothing
    proj = xtok_loss.Projection(False, proj.image_K[keep], proj.bucket_W.clone(), torch.tensor([5]), False, 1.0, 1.0)
    proj.bucket_W[5] = len(proj.image_K)  # the teacher's id 5 goes to the tail
    logits = torch.randn(1, 2, len(pair.s_bytes))
    logits[0, 1, 5] = float("-inf")  # the student's tail is empty at position 1 (outside its nucleus)
    logits.requires_grad_(True)
    s_q, t_q = xtok_loss.project(logits, torch.randn(1, 2, len(pair.t_bytes)).log_softmax(-1), proj)
    assert s_q[0, 1, -1].item() == float("-inf") and math.isfinite(t_q[0, 1, -1].item())
    losses.fkl_loss(s_q, t_q, torch.ones(1, 2), 2.0)[0].backward()
    assert torch.isfinite(logits.grad).all()


# --- one tokenizer on both sides: the shared path, bit for bit --------------------------------------------------


@pytest.fixture(scope="module")
def embedded_run():
    from opdkit.engines.hf import HFEngine
    from opdkit.setup import build_run, prepare_inputs

    cfg = replace(Config(), "runtime.threads=1", "teacher.tokenizer=own", "rollout.max_new_tokens=24")
    inputs = prepare_inputs(cfg)
    run = build_run(cfg, inputs, log=lambda *a: None)
    ex = inputs.examples[:3]
    ro = HFEngine(run.student, run.tokenizer).sample(run.prompts(ex), samples_per_prompt=2, seeds=list(range(6)),
                                                     temperature=1.0, top_p=1.0, max_new_tokens=24)
    return run, ex, ro


@pytest.mark.parametrize("loss", sorted(loss_table.XTOK))
def test_with_one_tokenizer_own_is_the_shared_path_bit_for_bit(embedded_run, loss):
    run, ex, ro = embedded_run
    shared = opd.Batch(ro, ro.prompt_ids_B_Sp, ro.prompt_mask_B_Sp)
    own = opd.Batch(ro, ro.prompt_ids_B_Sp, ro.prompt_mask_B_Sp)
    own.xtok = xtok.teacher_view(run.xtok, ro.completion_ids_B_T, ro.completion_mask_B_T,
                                 [p for p in run.teacher_prompts(ex) for _ in range(2)])
    assert bool(own.xtok.one_B_T[ro.completion_mask_B_T.bool()].all())
    out = {}
    for name, batch, tk in (("shared", shared, "shared"), ("own", own, "own")):
        cfg = replace(run.cfg, f"loss.name={loss}", f"teacher.tokenizer={tk}", "optim.micro_batch=4",
                      "runtime.logprob_chunk=16")
        run.student.zero_grad(set_to_none=True)
        kw = {"rollout": cfg.rollout, "runtime": cfg.runtime, "micro_batch": cfg.optim.micro_batch}
        ctx = opd_step.score_batch(cfg.loss, run.teacher, batch, contextlib.nullcontext, **kw)
        m = opd_step.micro_losses(cfg.loss, run.student, batch, ctx, contextlib.nullcontext,
                                  vocab_map=cfg.teacher.vocab_map, **kw)
        out[name] = (m, [p.grad.clone() for p in run.student.parameters()])
    (m_s, g_s), (m_o, g_o) = out["shared"], out["own"]
    assert m_o["loss"] == m_s["loss"] and m_o["kl"] == m_s["kl"] and m_o["xtok_one_to_one_frac"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(g_s, g_o))


# --- params, the loss table, the embedded BPE teacher ------------------------------------------------------------


@pytest.mark.parametrize("extra, needle", [
    (["loss.name=jsd"], "loss.name=jsd has no cross-tokenizer form"),
    (["loss.name=topk_fkl"], "loss.name=topk_fkl has no cross-tokenizer form"),
    (["teacher.source=privileged_fixed"], "is the student itself"),
    (["loss.name=rkl", "loss.teacher_temperature=2"], "leave it at 1"),
    (["data.pad_side=right"], "needs left"),
])
def test_what_cannot_run_across_tokenizers_is_refused(extra, needle):
    from opdkit.setup import RunError, check_params

    with pytest.raises(RunError, match=needle):
        check_params(replace(Config(), "teacher.tokenizer=own", "loss.name=k1", *extra))
    check_params(replace(Config(), "teacher.tokenizer=shared", *[e for e in extra if "tokenizer" in e]))


def test_the_loss_table_says_how_each_loss_runs_across_tokenizers():
    assert set(loss_table.XTOK) == {"k1", "k2", "k3", "rkl", "fkl"} <= set(loss_table.LOSS_NAMES)
    text = loss_table.xtok_help_text()
    for name in loss_table.LOSS_NAMES:
        assert f"  {name} " in text
    assert text.count("not supported") == len(loss_table.LOSS_NAMES) - len(loss_table.XTOK)


def test_the_bpe_teacher_is_built_once_and_reused(tmp_path):
    from opdkit.config import EmbeddedConfig
    from opdkit.embedded.bpe_teacher import build_bpe_teacher

    e = EmbeddedConfig(n_train=64, n_eval=4, hidden_size=16, layers=1, heads=2, intermediate_size=32, batch_size=8,
                       warmup_steps=1, teacher_steps=2, threads=1, bpe_vocab_size=300)
    threads, det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        a = build_bpe_teacher(tmp_path / "a", e, log=lambda *x: None)
        b = build_bpe_teacher(tmp_path / "b", e, log=lambda *x: None)
        said = []
        again = build_bpe_teacher(tmp_path / "a", e, log=said.append)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(det)
    assert a["files"] == b["files"] == again["files"] and "reused" in said[0]
    from opdkit.models import load_tokenizer

    tok = load_tokenizer(tmp_path / "a")
    assert len(tok) <= 300 and tok.convert_ids_to_tokens([0, 1, 2, 3]) == ["<pad>", "<bos>", "<eos>", "<unk>"]
