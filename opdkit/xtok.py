"""Cross-tokenizer OPD (``teacher.tokenizer: own``): the student's completion re-tokenized by the
teacher and the two token sequences aligned over the text into spans. Pure functions; the losses
over the spans are ``opdkit.xtok_loss``'s.

- **Text.** Every token id has a payload, the bytes it spells (``token_bytes``: byte-level BPE
  through the GPT-2 byte map, ``<0xNN>`` byte-fallback pieces, Metaspace's ``▁`` as a space, added
  and special tokens as their content). A completion's text is its tokens' payloads decoded as
  UTF-8 incrementally (``char_ends``), so each token covers the characters it completes: a token
  holding the first bytes of a character covers none (it joins the span of the token that ends the
  character), and bytes that never form a character become U+FFFD (an invalid or truncated tail).
- **Teacher tokens.** The student's completion without its final EOS is that text; the teacher's
  tokenizer encodes it (no special tokens added), and a completion that ended gets the teacher's
  end-of-answer id (``Pair.eos_to_teacher``: the teacher's stop id with the student EOS's payload,
  else the teacher's turn end / first EOS) as a span of its own. A truncated completion has none.
  The teacher's prompt is the same row rendered with the teacher's own tokenizer and chat template.
- **Spans** (``align_spans``): the minimal groups of consecutive student tokens and teacher tokens
  that cover the same characters: a span closes at the first character offset where a student token
  and a teacher token both end, each side holding at least one token, and (``close_stable``) where
  the teacher's tokens up to there cannot change with what follows (``Pair.closes``): where a teacher
  token could run on past that offset and the student's last token could not, the teacher ending its
  token there is decided by the student's *next* token (the next character), so the span stays open
  and takes it in. Otherwise the teacher's log-prob of a token that ends at a boundary (``1`` in
  ``1.`` where ``10`` is a token) would carry that boundary into the span before the choice that made
  it. A one-to-one span is one student token and one teacher token spelling the same text. With one
  tokenizer every common boundary closes.
- **Respelled rows.** A teacher tokenizer that normalises text (NFC, lowercasing, a prefix space)
  encodes tokens that do not spell the student's text; such a row is aligned as one span (its
  sequence log-probs compared as a whole) and counted (``xtok_respelled_frac``).
"""

from __future__ import annotations

import codecs
import itertools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from opdkit.engines.base import Rollout, left_pad

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level map, inverted: each of the 256 printable stand-in characters -> its byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + n)] = b
            n += 1
    return chars


def _decoder_kinds(tok) -> tuple[set[str], str | None]:
    """The backend decoder's types (a Sequence flattened) and the character it turns into a space."""
    dec = tok.backend_tokenizer.decoder
    node = json.loads(dec.__getstate__()) if dec is not None else {}
    kinds, space = set(), None
    stack = [node]
    while stack:
        d = stack.pop()
        kinds.add(d.get("type"))
        stack.extend(d.get("decoders") or [])
        if d.get("type") == "Metaspace":
            space = d.get("replacement", "\u2581")
        if d.get("type") == "Replace" and d.get("content") == " ":
            space = (d.get("pattern") or {}).get("String", space)
    return kinds, space


def token_bytes(tok) -> list[bytes]:
    """The payload of every id ``0 .. n-1`` of an HF fast tokenizer: the bytes the token spells."""
    vocab = tok.backend_tokenizer.get_vocab(with_added_tokens=True)
    n = max(len(tok), max(vocab.values()) + 1)
    by_id: list[str | None] = [None] * n
    for t, i in vocab.items():
        by_id[i] = t
    kinds, space = _decoder_kinds(tok)
    bl = byte_level_decoder() if "ByteLevel" in kinds else None
    to_latin1 = str.maketrans({c: chr(b) for c, b in bl.items()}) if bl else None  # stand-in -> its byte, in C
    keys = frozenset(bl) if bl else frozenset()
    added = {i: t.content for i, t in tok.added_tokens_decoder.items()}
    out = []
    for i, t in enumerate(by_id):
        if i in added:
            out.append(added[i].encode())
        elif t is None:
            out.append(b"")
        elif bl is not None and keys.issuperset(t):
            out.append(t.translate(to_latin1).encode("latin-1"))
        elif "ByteFallback" in kinds and _BYTE_FALLBACK.match(t):
            out.append(bytes([int(t[3:5], 16)]))
        else:
            out.append((t.replace(space, " ") if space else t).encode())
    return out


def char_ends(payloads: list[bytes]) -> tuple[str, list[int]]:
    """The text a token sequence spells and, per token, the character offset where it ends (UTF-8
    decoded incrementally: a token with the first bytes of a character ends where the previous one
    did; undecodable bytes become U+FFFD, a dangling tail on the last token)."""
    dec = codecs.getincrementaldecoder("utf-8")("replace")
    parts, ends, n = [], [], 0
    for p in payloads:
        s = dec.decode(p)
        parts.append(s)
        n += len(s)
        ends.append(n)
    tail = dec.decode(b"", final=True)
    if tail:
        parts.append(tail)
        n += len(tail)
        if ends:
            ends[-1] = n
    return "".join(parts), ends


def _texts(payloads: list[bytes]) -> list[str | None]:
    """Each payload as text where it is whole UTF-8 on its own, else None (part of a character)."""
    out = []
    for p in payloads:
        try:
            out.append(p.decode("utf-8"))
        except UnicodeDecodeError:
            out.append(None)
    return out


def _extensions(payloads: list[bytes], added: frozenset) -> dict[bytes, frozenset[int]]:
    """For every proper prefix of a token's bytes, the bytes that follow it in some token (added tokens,
    matched whole and never merged, left out)."""
    ext: dict[bytes, set[int]] = {}
    for i, p in enumerate(payloads):
        if i not in added:
            for n in range(1, len(p)):
                ext.setdefault(p[:n], set()).add(p[n])
    return {k: frozenset(v) for k, v in ext.items()}


def spell(ids: list[int], payloads: list[bytes], texts: list[str | None]) -> tuple[str, list[int]]:
    """``char_ends`` of the tokens ``ids``; without the incremental decoder where every token is whole
    text (the same result, faster)."""
    parts = [texts[i] for i in ids]
    if None in parts:
        return char_ends([payloads[i] for i in ids])
    return "".join(parts), list(itertools.accumulate(map(len, parts)))


def align_spans(s_ends: list[int], t_ends: list[int]) -> tuple[list[int], list[int], int]:
    """Span index of each student token and each teacher token, and the number of spans: the
    minimal groups covering the same characters (each side at least one token; zero-width tokens at
    the very end join the last span). Both sides must spell the same number of characters."""
    s_total, t_total = (s_ends[-1] if s_ends else 0), (t_ends[-1] if t_ends else 0)
    if s_total != t_total:
        raise ValueError(f"the two token sequences spell {s_total} and {t_total} characters: not the same text")
    s_span, t_span, k, i, j = [], [], 0, 0, 0
    while i < len(s_ends) and j < len(t_ends):
        s_span.append(k)
        t_span.append(k)
        i, j = i + 1, j + 1
        while s_ends[i - 1] != t_ends[j - 1]:
            if s_ends[i - 1] < t_ends[j - 1]:
                s_span.append(k)
                i += 1
            else:
                t_span.append(k)
                j += 1
        k += 1
    last = max(k - 1, 0)
    s_span += [last] * (len(s_ends) - i)
    t_span += [last] * (len(t_ends) - j)
    return s_span, t_span, (k or int(bool(s_ends or t_ends)))


@dataclass
class Pair:
    """What aligning one student/teacher tokenizer pair needs, built once (``make_pair``)."""

    s_bytes: list[bytes]
    t_bytes: list[bytes]
    s_eos: tuple[int, ...]  # the ids the student stops at
    t_end: int  # the teacher's end of an answer: its turn end (chat template) or first EOS
    t_stop: tuple[int, ...]  # the teacher's stop ids
    t_encode: Callable[[list[str]], list[list[int]]]  # texts -> teacher ids, no special tokens added
    s_encode: Callable[[list[str]], list[list[int]]]  # texts -> student ids (the vocabulary map's prefix mode)
    t_pad: int
    t_special: frozenset = frozenset()  # the teacher's special (added) ids
    s_unk: int | None = None  # the student's unknown-text id (text it cannot spell maps to no student id)
    s_added: frozenset = frozenset()  # each side's added (special and user-defined) ids: matched whole, never merged
    t_added: frozenset = frozenset()
    _cache: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self.s_text, self.t_text = _texts(self.s_bytes), _texts(self.t_bytes)
        self.s_ext, self.t_ext = _extensions(self.s_bytes, self.s_added), _extensions(self.t_bytes, self.t_added)
        self._closes: dict[tuple[bytes, int], bool] = {}
        self.t_max = max((len(b) for i, b in enumerate(self.t_bytes) if i not in self.t_added), default=0)

    def closes(self, text: bytes, s_id: int) -> bool:
        """Whether a span whose teacher tokens spell ``text`` (since its start or the teacher's last added
        token in it) may close where the student's token ``s_id`` ends too: unless some teacher token
        could run on past this point in a way the student's last token cannot (a teacher token starting
        with a suffix sigma of ``text`` and going on with a byte that no student token starting with
        sigma, inside ``s_id``, has next). Where one could, whether the teacher ends a token here is
        decided by the student's next token (the character after), so the span stays open and takes that
        token in (module docstring). Always true with one tokenizer."""
        key = (text[-self.t_max:], s_id)
        if key not in self._closes:
            if len(self._closes) > 1_000_000:  # bounded memory over a long run
                self._closes.clear()
            v = self.s_bytes[s_id] if s_id not in self.s_added else b""
            ok = True
            for n in range(1, min(len(text), self.t_max) + 1):
                sigma = text[-n:]
                t_next = self.t_ext.get(sigma)
                if t_next and not t_next <= (self.s_ext.get(sigma, frozenset()) if v.endswith(sigma) else frozenset()):
                    ok = False
                    break
            self._closes[key] = ok
        return self._closes[key]

    def eos_to_teacher(self, s_id: int) -> int:
        """The teacher id that ends an answer where the student's EOS ``s_id`` does."""
        same = [t for t in (*self.t_stop, self.t_end) if self.t_bytes[t] == self.s_bytes[s_id]]
        return same[0] if same else self.t_end


def make_pair(s_tok, t_tok, s_eos, t_stop, t_end: int) -> Pair:
    """A ``Pair`` of two HF fast tokenizers, the student's stop ids and the teacher's."""
    for what, tok in (("student", s_tok), ("teacher", t_tok)):
        if not getattr(tok, "is_fast", False):
            raise ValueError(f"teacher.tokenizer=own needs fast (tokenizer.json) tokenizers; the {what}'s is "
                             f"{type(tok).__name__}")
    t_pad = t_tok.pad_token_id if t_tok.pad_token_id is not None else t_end
    return Pair(token_bytes(s_tok), token_bytes(t_tok), tuple(s_eos), int(t_end), tuple(t_stop),
                lambda texts: t_tok(texts, add_special_tokens=False).input_ids if texts else [],
                lambda texts: s_tok(texts, add_special_tokens=False).input_ids if texts else [], t_pad,
                frozenset(i for i, t in t_tok.added_tokens_decoder.items() if t.special), s_tok.unk_token_id,
                frozenset(s_tok.added_tokens_decoder), frozenset(t_tok.added_tokens_decoder))


@dataclass
class RowAlignment:
    t_ids: list[int]  # the teacher's completion (its EOS last where the student's ended)
    s_span: list[int]  # span of each student token
    t_span: list[int]  # span of each teacher token
    n_spans: int
    respelled: bool  # the teacher's tokens did not spell the student's text: one span


def align_rows(pair: Pair, rows: list[list[int]]) -> list[RowAlignment]:
    """Each student completion (its real tokens, EOS included where it ended) re-tokenized by the
    teacher and aligned (module docstring)."""
    ended = [bool(r) and r[-1] in pair.s_eos for r in rows]
    spelled = [spell(r[:-1] if e else r, pair.s_bytes, pair.s_text) for r, e in zip(rows, ended)]
    t_rows = pair.t_encode([text for text, _ in spelled])
    out = []
    for r, e, (text, s_ends), t_ids in zip(rows, ended, spelled, t_rows):
        t_ids = list(t_ids)
        t_text, t_ends = spell(t_ids, pair.t_bytes, pair.t_text)
        respelled = t_text != text
        if respelled:
            n, closed = int(bool(s_ends or t_ids)), True
            s_span, t_span = [0] * len(s_ends), [0] * len(t_ids)
        else:
            s_span, t_span, n, closed = close_stable(pair, *align_spans(s_ends, t_ends), r, t_ids)
        if e:  # the EOS: a span of its own, unless the last span stays open (then the EOS closes it)
            last = n - 1 if n and not (respelled or closed) else n
            s_span.append(last)
            t_span.append(last)
            t_ids.append(pair.eos_to_teacher(r[-1]))
            n = last + 1
        out.append(RowAlignment(t_ids, s_span, t_span, n, respelled))
    return out


def close_stable(pair: Pair, s_span: list[int], t_span: list[int], n: int, s_ids: list[int], t_ids: list[int]):
    """``align_spans``' spans with those that may not close (``Pair.closes``) merged into the next; and
    whether the last may close (before an EOS)."""
    last_s, last_t = {j: i for i, j in enumerate(s_span)}, {j: k for k, j in enumerate(t_span)}
    new, cur, start = [], 0, 0  # start: the first teacher token whose bytes the open span's check reads
    ok = True
    for j in range(n):
        new.append(cur)
        end = last_t[j]
        added = [k for k in range(start, end + 1) if t_ids[k] in pair.t_added]
        text = b"".join(pair.t_bytes[t_ids[k]] for k in range(added[-1] + 1 if added else start, end + 1))
        ok = pair.closes(text, s_ids[last_s[j]])
        if ok and j < n - 1:
            cur, start = cur + 1, end + 1
    return [new[j] for j in s_span], [new[j] for j in t_span], (cur + 1 if n else 0), ok


@dataclass
class XtokBatch:
    """A step's teacher view and alignment (``teacher_view``). Student tensors are ``B_T`` (the
    rollout's completion columns), teacher tensors ``B_U`` (the teacher's completion columns)."""

    teacher: Rollout  # the teacher's prompts and completions, laid out as a rollout (left / right padded)
    s_span_B_T: torch.Tensor  # span of each student token, -1 past the completion
    t_span_B_U: torch.Tensor  # span of each teacher token, -1 past its completion
    s_len_B_T: torch.Tensor  # student tokens in the token's span (0 past the completion)
    one_B_T: torch.Tensor  # bool: the token's span is one-to-one
    t_pos_B_T: torch.Tensor  # a one-to-one span's teacher column (0 elsewhere)
    n_spans_B: torch.Tensor
    respelled_B: torch.Tensor  # bool
    pair: Pair


def teacher_view(pair: Pair, completion_ids_B_T: torch.Tensor, completion_mask_B_T: torch.Tensor,
                 teacher_prompts: list[list[int]]) -> XtokBatch:
    """The teacher's view of a step's completions: each row's teacher prompt (``teacher_prompts``,
    its own rendering of the row) and the completion re-tokenized (``align_rows``), laid out as a
    rollout (left-padded prompts, right-padded completions at least as wide as the student's)."""
    device = completion_ids_B_T.device
    n_B = completion_mask_B_T.long().sum(1).tolist()
    rows = [ids[:n] for ids, n in zip(completion_ids_B_T.tolist(), n_B)]
    al = align_rows(pair, rows)
    B, T = completion_ids_B_T.shape
    U = max([T] + [len(a.t_ids) for a in al])
    t_ids_B_U = np.full((B, U), pair.t_pad, dtype=np.int64)
    t_mask_B_U = np.zeros((B, U), dtype=np.float32)
    t_span_B_U, s_span_B_T = np.full((B, U), -1, dtype=np.int64), np.full((B, T), -1, dtype=np.int64)
    s_len_B_T, t_pos_B_T = np.zeros((B, T), dtype=np.float32), np.zeros((B, T), dtype=np.int64)
    one_B_T = np.zeros((B, T), dtype=bool)
    for b, a in enumerate(al):  # spans are numbered in order on both sides: each side's span ids never decrease
        u, n = len(a.t_ids), n_B[b]
        t_ids_B_U[b, :u], t_mask_B_U[b, :u], t_span_B_U[b, :u] = a.t_ids, 1, a.t_span
        s_span = np.asarray(a.s_span, dtype=np.int64)
        t_span = np.asarray(a.t_span, dtype=np.int64)
        s_n, t_n = np.bincount(s_span, minlength=a.n_spans), np.bincount(t_span, minlength=a.n_spans)
        s_span_B_T[b, :n], s_len_B_T[b, :n] = s_span, s_n[s_span]
        one_B_T[b, :n] = (s_n[s_span] == 1) & (t_n[s_span] == 1)
        first_t = np.searchsorted(t_span, np.arange(a.n_spans))  # each span's first teacher column
        t_pos_B_T[b, :n] = np.where(one_B_T[b, :n], first_t[s_span], 0)
    t = lambda x: torch.from_numpy(x).to(device)  # noqa: E731
    p_ids_B_S, p_mask_B_S = left_pad(teacher_prompts, pair.t_pad, device)
    teacher = Rollout(p_ids_B_S, p_mask_B_S, t(t_ids_B_U), t(t_mask_B_U), None,
                      torch.zeros(B, dtype=torch.bool, device=device), torch.arange(B, device=device))
    return XtokBatch(teacher, t(s_span_B_T), t(t_span_B_U), t(s_len_B_T), t(one_B_T), t(t_pos_B_T),
                     torch.tensor([a.n_spans for a in al], device=device),
                     torch.tensor([a.respelled for a in al], device=device), pair)


def span_sum(x_B_N: torch.Tensor, span_B_N: torch.Tensor, n_spans: int) -> torch.Tensor:
    """(B, n_spans): the sum of ``x`` over each span's tokens (entries with span -1 left out). A
    one-token span's sum is the token's value exactly."""
    keep_B_N = span_B_N >= 0
    out = torch.zeros((x_B_N.shape[0], max(n_spans, 1)), dtype=x_B_N.dtype, device=x_B_N.device)
    return out.scatter_add_(1, span_B_N.clamp_min(0), torch.where(keep_B_N, x_B_N, torch.zeros_like(x_B_N)))


def span_stats(xb: XtokBatch) -> dict:
    """The step's alignment in numbers: share of student tokens in one-to-one spans, student and
    teacher tokens per span, share of respelled rows."""
    s_mask = xb.s_span_B_T >= 0
    n_s, n_t, n_spans = int(s_mask.sum()), int((xb.t_span_B_U >= 0).sum()), int(xb.n_spans_B.sum())
    return {"xtok_one_to_one_frac": float(xb.one_B_T.sum()) / max(n_s, 1),
            "xtok_student_per_span": n_s / max(n_spans, 1), "xtok_teacher_per_span": n_t / max(n_spans, 1),
            "xtok_respelled_frac": float(xb.respelled_B.float().mean()) if xb.respelled_B.numel() else 0.0}
