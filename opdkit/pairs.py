"""Pre-flight checks that a student/teacher pair and its data will work together, each in one place.

Shared by ``opdkit train``'s preflight (``setup.prepare_inputs`` calls ``check_inputs(cfg,
strict=True)``: the first failure raises its error, exit 2, nothing written) and ``opdkit doctor``
(``strict=False``: every check that can run does, each gives ``Finding`` lines, OK / WARN / FAIL /
SKIP with the fix). These read files only (configs, tokenizers, data rows); the checks that load
and run the models are ``opdkit.doctor``'s.

- model directories (``models.check_model_dir``) and the training data (``data.load_examples``);
- the chat template: present where ``data.chat_template`` renders prompts with it; chat-message
  rows with ``data.chat_template=false`` are flattened to plain text; the teacher's template the
  same as the student's (the student's renders the prompts both models see);
- thinking: each side's ``enable_thinking`` (``data.enable_thinking``, ``data.teacher_enable_thinking``)
  and whether the template reads it;
- one vocabulary: the same token ids, the same split of a data row; or, with
  ``teacher.tokenizer=own`` (cross-tokenizer OPD, ``opdkit.xtok``), the pair's alignment instead:
  the share of one-to-one spans on a sample of rows, the vocabulary map of rkl / fkl, each model's
  rows against its own tokenizer;
- embedding rows: at least the tokenizer's ids in each model (rows past them are padding,
  excluded from sampling and scoring: ``use_shared_vocab``);
- special tokens: the ids the engines stop at (``engines.base.pad_and_eos``) agree between the
  pair and hold the token that ends an assistant turn in the chat template;
- generation config: settings in a checkpoint's generation_config.json that would change how it
  samples, which opdkit's engines set aside (they sample with ``rollout.temperature`` /
  ``rollout.top_p`` and nothing else).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import jinja2
import torch

from opdkit import loss_table, paths
from opdkit.config import Config
from opdkit.data import TEACHER_REFERENCES, DataError, Example, fingerprint, load_examples
from opdkit.engines.base import pad_and_eos
from opdkit.models import ModelError, check_model_dir, config_rows, load_tokenizer, model_rows, tokenizer_ids
from opdkit.scoring import restrict_vocab

OK, WARN, FAIL, SKIP = "OK", "WARN", "FAIL", "SKIP"
# generation_config.json keys that change what generate() / vLLM's defaults sample, with their neutral values.
# opdkit's engines apply none of them (engines.hf.decode reads no generation config).
SAMPLING_CHANGERS: dict[str, tuple] = {
    "repetition_penalty": (None, 1, 1.0), "encoder_repetition_penalty": (None, 1, 1.0),
    "no_repeat_ngram_size": (None, 0), "encoder_no_repeat_ngram_size": (None, 0),
    "top_k": (None, 0), "min_p": (None, 0, 0.0), "typical_p": (None, 1, 1.0),
    "epsilon_cutoff": (None, 0, 0.0), "eta_cutoff": (None, 0, 0.0),
    "min_new_tokens": (None, 0), "min_length": (None, 0), "bad_words_ids": (None, []), "suppress_tokens": (None, []),
    "begin_suppress_tokens": (None, []), "forced_bos_token_id": (None,), "forced_eos_token_id": (None,),
    "sequence_bias": (None, {}), "exponential_decay_length_penalty": (None,), "num_beams": (None, 1),
}
REPLACED = ("temperature", "top_p")  # opdkit's own knobs: rollout.* (training) and eval.* (opdkit eval)


class PairError(ModelError):
    """A failed pair check: ``problem`` and ``fix`` (what to change); the message is both."""

    def __init__(self, problem: str, fix: str):
        super().__init__(f"{problem}; {fix}")
        self.problem, self.fix = problem, fix


@dataclass(frozen=True)
class Finding:
    """One line of the checks' table."""

    check: str
    status: str  # OK | WARN | FAIL | SKIP
    detail: str
    fix: str = ""


@dataclass
class Inputs:
    """What a run reads, checked (``check_inputs``)."""

    student_path: Path
    teacher_path: Path | None  # None: a privileged teacher (the student itself)
    train_path: Path
    examples: list[Example]
    data_fingerprint: str
    tokenizer: object  # the student's (it encodes every prompt, the teacher's too)
    teacher_tokenizer: object = None
    warnings: list[Finding] = field(default_factory=list)
    teacher_paths: dict[str, Path] = field(default_factory=dict)  # "teacher model" (or "teacher NAME model") -> dir
    xtok: object = None  # teacher.tokenizer=own: the tokenizer pair (opdkit.xtok.Pair)
    offline: object = None  # rollout.source=offline: the pool the run reads (opdkit.offline.Pool)


# fixes for the errors raised by the loaders (a PairError carries its own)
FIXES = {
    "student model": "point student.path (doctor: --student) at an HF model directory: config.json, weights, tokenizer",
    "teacher model": "point teacher.path (doctor: --teacher) at an HF model directory: config.json, weights, tokenizer",
    "data": "point data.train (doctor: --data) at a parquet/jsonl of prompts in a known row shape (opdkit.data)",
}
_FAILED = object()  # what a failed check hands the checks that need its result


class Checks:
    """Runs checks in order, collecting ``Finding``s. ``strict``: a check's error propagates (train's
    preflight); else it becomes a FAIL line and the checks that need its result are skipped."""

    def __init__(self, strict: bool):
        self.strict, self.findings = strict, []

    @property
    def failed(self) -> bool:
        return any(f.status == FAIL for f in self.findings)

    def run(self, check: str, fn, *args):
        """``fn(*args) -> (value, findings)``; returns the value (``_FAILED`` where it or a check it
        needs failed)."""
        if any(a is _FAILED or (isinstance(a, dict) and _FAILED in a.values()) for a in args):
            self.findings.append(Finding(check, SKIP, "not checked: a check it needs failed (above)"))
            return _FAILED
        try:
            value, found = fn(*args)
        except (ModelError, DataError) as e:
            if self.strict:
                raise
            problem, fix = (e.problem, e.fix) if isinstance(e, PairError) else (str(e), FIXES.get(check, ""))
            self.findings.append(Finding(check, FAIL, problem, fix))
            return _FAILED
        self.findings.extend(found)
        return value


def check_inputs(cfg: Config, strict: bool) -> tuple[Inputs | None, list[Finding]]:
    """Every file-level check of the run's pair and data, in order; ``Inputs`` (None when a check
    failed) and the findings. ``strict``: the first failure raises (``ModelError`` / ``DataError``)."""
    c = Checks(strict)
    src = cfg.teacher.source
    with_teacher = src in ("model", "vllm")
    s_dir = c.run("student model", model_dir, paths.student_path(cfg), "student model")
    served = src == "vllm" and all(teacher_urls(cfg).values())  # a server holds the weights: config + tokenizer here
    t_dirs = {role: c.run(f"{role} model", model_dir, path, f"{role} model", not served)
              for role, path in teacher_roles(cfg).items()} if with_teacher else {}
    if not with_teacher:
        c.findings.append(Finding("teacher model", OK, f"teacher.source={src}: the student, given the "
                                  "reference solution in its prompt, is its own teacher (no teacher model)"))
    train_path = paths.train_data_path(cfg)
    # before the data: the length filters count its tokens
    s_tok = c.run("student tokenizer", tokenizer_of, s_dir, "student model")
    examples = c.run("data", training_data, cfg, train_path, s_tok)
    t_toks = {role: c.run(f"{role} tokenizer", tokenizer_of, d, f"{role} model") for role, d in t_dirs.items()}
    own = cfg.teacher.tokenizer == "own" and with_teacher  # cross-tokenizer: the teacher keeps its own tokenizer
    pair = None
    for role in t_dirs or [None]:  # each teacher against the student (one teacher: the checks' plain names)
        t_dir, t_tok = t_dirs.get(role), t_toks.get(role)
        name = "" if role in (None, "teacher") else f" ({role})"
        c.run("chat template" + name, chat_template, cfg, s_dir, t_dir, s_tok, t_tok, examples)
        if role in (None, next(iter(t_dirs), None)):  # once: the student's template renders every side's prompts
            c.run("thinking", thinking_state, cfg, s_tok)
        if role is not None and own:
            pair = c.run("vocabulary" + name, cross_tokenizer, cfg, s_tok, t_tok, s_dir, t_dir, examples)
        elif role is not None:
            c.run("vocabulary" + name, vocabulary, s_tok, t_tok, s_dir, t_dir, examples)
        c.run("special tokens" + name, special_tokens, cfg, s_tok, t_tok,
              {"student": s_dir, **({"teacher": t_dir} if role is not None else {})})
    dirs = {"student": s_dir, **t_dirs}
    if own:  # each model's rows against its own tokenizer
        c.run("embedding rows", embedding_rows, s_tok, {"student": s_dir})
        for role, t_dir in t_dirs.items():
            c.run(f"embedding rows ({role})", embedding_rows, t_toks[role], {role: t_dir}, f"embedding rows ({role})")
    else:
        c.run("embedding rows", embedding_rows, s_tok, dirs)
    if src == "vllm":
        c.run("embedding rows (vllm)", vllm_rows, t_toks[next(iter(t_dirs))] if own else s_tok, t_dirs)
    for role, d in dirs.items():
        c.run(f"generation config ({role})", generation_config, cfg, d, role)
    if c.failed:
        return None, c.findings
    first = next(iter(t_dirs.values()), None)
    inputs = Inputs(s_dir, first, train_path, examples, fingerprint(examples), s_tok,
                    t_toks.get(next(iter(t_dirs), None)), [f for f in c.findings if f.status == WARN],
                    {f"{role} model": d for role, d in t_dirs.items()}, pair)
    return inputs, c.findings


def teacher_roles(cfg: Config) -> dict[str, Path]:
    """The teacher models of a run by role: ``teacher`` (teacher.path), or ``teacher NAME`` for each of
    several (params key ``teachers``)."""
    if cfg.teachers:
        return {f"teacher {t.name}": Path(t.path) for t in cfg.teachers}
    return {"teacher": paths.teacher_path(cfg)}


def teacher_urls(cfg: Config) -> dict[str, str]:
    """teacher.source=vllm: each teacher role's server URL ("" = a colocated engine)."""
    if cfg.teachers:
        return {f"teacher {t.name}": t.url for t in cfg.teachers}
    return {"teacher": cfg.teacher.url}


# --- the checks: each returns (value, findings) or raises ModelError / DataError ---------------


def model_dir(path: Path, what: str, weights: bool = True):
    p = check_model_dir(path, what, weights)
    try:
        cfg = json.loads((p / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise PairError(f"{what} directory {p}: config.json is not valid JSON ({e})",
                        "re-export the model with save_pretrained") from None
    if not isinstance(cfg, dict):
        raise PairError(f"{what} directory {p}: config.json is not a JSON object",
                        "re-export the model with save_pretrained")
    arch = ", ".join(cfg.get("architectures") or [cfg.get("model_type", "?")])
    return p, [Finding(what, OK, f"{p} ({arch})")]


def required_references(cfg: Config) -> tuple[str, ...]:
    """The references every training row needs: a privileged teacher's context, sft's solutions."""
    need = TEACHER_REFERENCES[cfg.data.teacher_context] if cfg.teacher.source.startswith("privileged") else ()
    if loss_table.samples_from(cfg.loss) == "reference" and "solution" not in need:
        need += ("solution",)
    return need


def training_data(cfg: Config, path: Path, tokenizer=None):
    examples = load_examples(path, cfg.data, require=required_references(cfg), tokenizer=tokenizer,
                             teachers=tuple(t.name for t in cfg.teachers) if cfg.teachers else None)
    n_chat = sum(not isinstance(ex.prompt, str) for ex in examples)
    shape = ("chat messages" if n_chat == len(examples) else "plain-text prompts" if not n_chat
             else f"{n_chat} chat-message and {len(examples) - n_chat} plain-text prompts")
    return examples, [Finding("data", OK, f"{path}: {len(examples):,} rows selected ({shape})")]


def tokenizer_of(path: Path, what: str):
    try:
        return load_tokenizer(path), []
    except (OSError, ValueError) as e:  # transformers' reasons span lines; the error is one
        raise PairError(f"{what} directory {path}: its tokenizer cannot be loaded ({type(e).__name__}: "
                        f"{' '.join(str(e).split())})",
                        "expected an HF tokenizer there (tokenizer.json + tokenizer_config.json)") from None


def check_chat_template(tok, path: str | Path, what: str = "model") -> None:
    """``data.chat_template=true`` renders every prompt with this tokenizer's chat template."""
    if getattr(tok, "chat_template", None) is None:
        raise PairError(f"{what} directory {path}: data.chat_template=true but its tokenizer has no chat template "
                        "(expected 'chat_template' in tokenizer_config.json, or chat_template.jinja)",
                        "add one, or set data.chat_template=false (prompts are then plain text)")


def chat_template(cfg: Config, s_dir, t_dir, s_tok, t_tok, examples: list[Example]):
    out = []
    n_chat = sum(not isinstance(ex.prompt, str) for ex in examples)
    if not cfg.data.chat_template:
        if n_chat:
            out.append(Finding("chat template", WARN, f"{n_chat:,} of {len(examples):,} rows are chat messages but "
                               "data.chat_template=false: each becomes its messages' contents joined as plain text, "
                               "without the role markers a chat-tuned model was trained on",
                               "-S data.chat_template=true renders them with the student's chat template (keep false "
                               "on purpose for a base model)"))
        else:
            out.append(Finding("chat template", OK, "not used: plain-text prompts, data.chat_template=false"))
        return None, out
    check_chat_template(s_tok, s_dir, "student model")
    if t_tok is not None and cfg.teacher.tokenizer == "own":
        check_chat_template(t_tok, t_dir, "teacher model")
        return None, [Finding("chat template", OK, "data.chat_template=true, teacher.tokenizer=own: each model's own "
                              "template renders its prompt of the row")]
    detail = "data.chat_template=true: the student's template renders every prompt (the teacher sees the same tokens)"
    if t_tok is not None and getattr(t_tok, "chat_template", None) != s_tok.chat_template:
        out.append(Finding("chat template", WARN, f"the teacher's chat template ({t_dir}) differs from the student's "
                           f"({'it has none' if t_tok.chat_template is None else 'other text'}): the teacher scores "
                           "prompts rendered in the student's format",
                           "fine for a teacher tuned on the same format; else use a teacher of the student's chat "
                           "format"))
    else:
        out.append(Finding("chat template", OK, detail + ("; the teacher's is the same" if t_tok is not None else "")))
    return None, out


THINKING_PROBE = [{"role": "user", "content": "What is 1+1?"}]


def template_reads_thinking(tok) -> bool | None:
    """Whether the tokenizer's chat template renders differently with enable_thinking true and false
    (Qwen3's does; Qwen2.5's and DeepSeek-R1-Distill-Qwen's do not); None where it cannot render."""
    try:
        on, off = (tok.apply_chat_template(THINKING_PROBE, add_generation_prompt=True, tokenize=False,
                                           enable_thinking=v) for v in (True, False))
    except (jinja2.TemplateError, ValueError, TypeError):
        return None
    return on != off


def thinking_state(cfg: Config, s_tok):
    """The thinking state of each side's prompts (``data.enable_thinking`` / ``teacher_enable_thinking``,
    passed to the student's chat template, which renders every prompt); a teacher model scores the
    student's prompt tokens, so a teacher setting of its own is refused there."""
    d = cfg.data
    privileged = cfg.teacher.source.startswith("privileged")
    state = {True: "on", False: "off"}
    if not privileged and d.teacher_enable_thinking != d.enable_thinking:
        raise PairError(f"data.teacher_enable_thinking={str(d.teacher_enable_thinking).lower()} differs from "
                        f"data.enable_thinking={str(d.enable_thinking).lower()}, but "
                        f"teacher.source={cfg.teacher.source} scores the student's prompt tokens (one rendering for "
                        "both)",
                        f"set data.teacher_enable_thinking={str(d.enable_thinking).lower()} (it applies to a "
                        "privileged teacher's own prompt)")
    if not d.chat_template:
        off = [k for k in ("enable_thinking", "teacher_enable_thinking") if not getattr(d, k)]
        if off:
            return None, [Finding("thinking", WARN, f"data.{off[0]}=false has no effect: data.chat_template=false (no "
                                  "template to pass it to)", "-S data.chat_template=true, or leave it true")]
        return None, [Finding("thinking", OK, "not used: no chat template (data.chat_template=false)")]
    reads = template_reads_thinking(s_tok)
    teacher = (f"the privileged teacher's prompt {state[d.teacher_enable_thinking]} (data.teacher_enable_thinking)"
               if privileged else "the teacher scores the student's prompt tokens")
    if reads is None:
        return None, [Finding("thinking", WARN, "the chat template could not render a one-message probe with "
                              "enable_thinking, so its thinking state is unknown", "check the template")]
    if not reads:
        detail = ("the chat template does not read enable_thinking (as Qwen2.5's and DeepSeek-R1-Distill-Qwen's): the "
                  "prompts are the same either way")
        if not (d.enable_thinking and d.teacher_enable_thinking):
            return None, [Finding("thinking", WARN, detail + "; data.*enable_thinking=false changes nothing here",
                                  "fine for such a model; a Qwen3-style model would read it")]
        return None, [Finding("thinking", OK, detail)]
    return None, [Finding("thinking", OK, f"the chat template reads enable_thinking: the student's prompts "
                          f"{state[d.enable_thinking]} (data.enable_thinking; off: the answer opens with the "
                          f"template's empty thinking block), {teacher}")]


def check_same_vocab(student_tok, teacher_tok, student_dir: str | Path = "", teacher_dir: str | Path = "") -> None:
    """Teacher and student must share token ids; else name the first mismatch (and the dirs)."""
    sv, tv = student_tok.get_vocab(), teacher_tok.get_vocab()
    if sv == tv:
        return
    by_id_s = {i: t for t, i in sv.items()}
    by_id_t = {i: t for t, i in tv.items()}
    where = f" ({student_dir} vs {teacher_dir})" if student_dir or teacher_dir else ""
    for i in sorted(set(by_id_s) | set(by_id_t)):
        if by_id_s.get(i) != by_id_t.get(i):
            raise PairError(
                f"teacher and student tokenizers disagree{where}: token id {i} is {by_id_s.get(i)!r} for the student "
                f"and {by_id_t.get(i)!r} for the teacher (sizes {len(sv)} vs {len(tv)})",
                "OPD needs one vocabulary: use a teacher of the student's tokenizer family (embedding rows past the "
                "tokenizer's ids may differ, the ids themselves may not), or -S teacher.tokenizer=own (cross-tokenizer "
                "OPD: the teacher scores the text in its own tokens)")


def check_same_tokenization(student_tok, teacher_tok, ex: Example) -> None:
    """Same vocabulary is not enough: the two tokenizers must also split text the same way
    (transformers may pick a model-type-specific tokenizer class with its own pre-tokenizer)."""
    probe = ex.problem_text + " " + ex.solution
    s_ids, t_ids = student_tok(probe).input_ids, teacher_tok(probe).input_ids
    if s_ids != t_ids:
        i = next((i for i, (a, b) in enumerate(zip(s_ids, t_ids)) if a != b), min(len(s_ids), len(t_ids)))
        raise PairError(
            f"teacher and student tokenizers split the same text differently ({type(student_tok).__name__} vs "
            f"{type(teacher_tok).__name__}); first difference at token {i} of {probe[:60]!r}",
            "OPD needs identical tokenization: load both with the same tokenizer class (tokenizer_config.json's "
            "tokenizer_class), or -S teacher.tokenizer=own (cross-tokenizer OPD)")


def vocabulary(s_tok, t_tok, s_dir, t_dir, examples: list[Example]):
    check_same_vocab(s_tok, t_tok, s_dir, t_dir)
    check_same_tokenization(s_tok, t_tok, examples[0])
    return None, [Finding("vocabulary", OK, f"the same {tokenizer_ids(s_tok):,} token ids in both tokenizers; "
                          "they split a data row the same way")]


def xtok_end_id(cfg: Config, t_tok, t_eos: list[int]) -> int:
    """teacher.tokenizer=own: the teacher id that ends an answer: its chat template's turn end where
    prompts are rendered with it, else its first stop id."""
    end = turn_end_id(t_tok) if cfg.data.chat_template and getattr(t_tok, "chat_template", None) else None
    return end if end is not None else t_eos[0]


def cross_tokenizer(cfg: Config, s_tok, t_tok, s_dir, t_dir, examples: list[Example]):
    """teacher.tokenizer=own: the tokenizer pair (``opdkit.xtok.Pair``) and how its tokenizations of
    the data align: on the first ``doctor.xtok_rows`` rows' reference solutions (else their problems),
    the share of spans that are one-to-one; with rkl / fkl, the vocabulary map's coverage."""
    from opdkit import xtok, xtok_loss

    _, s_eos = stop_ids(s_dir, s_tok)
    _, t_eos = stop_ids(t_dir, t_tok)
    try:
        pair = xtok.make_pair(s_tok, t_tok, s_eos, t_eos, xtok_end_id(cfg, t_tok, t_eos))
    except ValueError as e:
        raise PairError(f"teacher model directory {t_dir}: {e}", "save both tokenizers as tokenizer.json") from None
    rows = examples[: cfg.doctor.xtok_rows]
    what = "reference solutions" if all(ex.solution for ex in rows) else "problems"
    texts = [ex.solution if what == "reference solutions" else ex.problem_text for ex in rows]
    al = xtok.align_rows(pair, [ids + [s_eos[0]] for ids in s_tok(texts, add_special_tokens=False).input_ids])
    n_spans = sum(a.n_spans for a in al)
    counts = [(Counter(a.s_span), Counter(a.t_span)) for a in al]
    one = sum(sum(n == 1 and t_n[j] == 1 for j, n in s_n.items()) for s_n, t_n in counts)
    n_s, n_t, respelled = sum(len(a.s_span) for a in al), sum(len(a.t_span) for a in al), sum(a.respelled for a in al)
    detail = (f"cross-tokenizer pair (teacher.tokenizer=own): student {len(pair.s_bytes):,} ids, teacher "
              f"{len(pair.t_bytes):,}; on {len(rows)} rows' {what} (+ EOS), {one / max(n_spans, 1):.1%} of {n_spans:,} "
              f"spans align one-to-one ({n_s / max(n_spans, 1):.2f} student and {n_t / max(n_spans, 1):.2f} teacher "
              f"tokens per span), {respelled} rows respelled by the teacher's tokenizer")
    if loss_table.spec(cfg.loss.name).teacher == "full":
        proj = xtok_loss.make_projection(pair, cfg.teacher.vocab_map)
        detail += (f"; vocabulary map ({cfg.teacher.vocab_map}): {proj.mapped_frac:.1%} of the teacher's ids map to a "
                   f"student id ({proj.exact_frac:.1%} by identical bytes), the rest to the tail bucket")
    if s_tok.get_vocab() == t_tok.get_vocab():
        detail += ("; the two vocabularies are the same (teacher.tokenizer=shared scores the same ids without "
                   "re-tokenizing)")
    if respelled:
        return pair, [Finding("vocabulary", WARN, detail + ": its tokens do not spell the text it encoded "
                              "(it normalises text), so each such row is aligned as one span",
                              "a teacher tokenizer without a normaliser gives a finer signal; the rows still train")]
    return pair, [Finding("vocabulary", OK, detail)]


def check_vocab_rows(tok, rows: dict[str, int], path: str | Path, what: str = "model") -> int:
    """Every id the tokenizer can emit must have a row in the model's input and output
    embeddings (``rows``: ``config_rows`` or ``model_rows``); returns the output rows (rows past
    the tokenizer's ids are padding)."""
    n = tokenizer_ids(tok)
    for kind, r in rows.items():
        if r < n:
            raise PairError(f"{what} directory {path}: its {kind} embedding has {r:,} rows but the tokenizer can emit "
                            f"ids 0..{n - 1:,}",
                            f"expected at least {n:,} rows: a model and tokenizer of one family")
    return rows["output"]


def embedding_rows(tok, dirs: dict[str, Path], check: str = "embedding rows"):
    n = tokenizer_ids(tok)
    rows = {role: check_vocab_rows(tok, config_rows(d), d, f"{role} model") for role, d in dirs.items()}
    sizes = ", ".join(f"{role} {r:,}" for role, r in rows.items())
    if all(r == n for r in rows.values()):
        return None, [Finding(check, OK, f"{sizes} rows = the tokenizer's {n:,} ids (no padding rows)")]
    pads = ", ".join(f"{role} {r - n:,}" for role, r in rows.items())
    return None, [Finding(check, OK, f"{sizes} rows for the tokenizer's {n:,} ids: padding rows {pads}, "
                          "never sampled, excluded from scoring (log-probs renormalised over the shared ids)")]


def vllm_rows(tok, t_dirs: dict[str, Path]):
    """teacher.source=vllm: vLLM normalises prompt log-probs over every embedding row, so a teacher
    it scores with must hold exactly the tokenizer's ids (the HF teacher's ``SharedVocabHead``)."""
    n = tokenizer_ids(tok)
    for role, d in t_dirs.items():
        rows = config_rows(d)["output"]
        if rows != n:
            raise PairError(f"{role} model directory {d}: {rows:,} embedding rows for the tokenizer's {n:,} ids; vLLM "
                            "normalises its prompt log-probs over every row, so the padding rows would take part of "
                            "the teacher's probability (the HF teacher scores over the tokenizer's ids only)",
                            f"write a copy cut to those ids and point the teacher's path (and `vllm serve`) at it: "
                            f"opdkit vocab-cut --model {d} --out {d}-cut")
    return None, [Finding("embedding rows (vllm)", OK, f"the teacher's rows are the tokenizer's {n:,} ids: vLLM's "
                          "prompt log-probs are normalised over the ids the HF teacher scores over")]


def use_shared_vocab(tok, models: dict[str, tuple[str | Path, torch.nn.Module]], log=print) -> int:
    """Check each loaded model's rows against the tokenizer, then score every model over the shared
    vocabulary (the tokenizer's ids; padding rows excluded, log-probs renormalised over it) and
    say so. ``models``: what -> (directory, model), before any LoRA wrapping. Returns n."""
    n = tokenizer_ids(tok)
    rows = {what: check_vocab_rows(tok, model_rows(model), path, what) for what, (path, model) in models.items()}
    for _, model in models.values():
        restrict_vocab(model, n)
    if any(r != n for r in rows.values()):
        sizes = ", ".join(f"{what} {r:,}" for what, r in rows.items())
        log(f"shared vocabulary: scoring over the tokenizer's {n:,} ids; embedding rows {sizes}: the padding rows "
            "past them are excluded and log-probs renormalised over the shared ids")
    return n


def stop_ids(path: Path, tok) -> tuple[int, list[int]]:
    """(pad id, EOS ids) the engines use for the model in ``path``: ``pad_and_eos`` on the
    generation config ``from_pretrained`` gives the model (generation_config.json, else config.json's)."""
    from transformers import AutoConfig, GenerationConfig

    if (Path(path) / "generation_config.json").is_file():
        gc = GenerationConfig.from_pretrained(str(path))
    else:
        gc = GenerationConfig.from_model_config(AutoConfig.from_pretrained(str(path)))
    return pad_and_eos(SimpleNamespace(generation_config=gc), tok)


def _names(tok, ids) -> str:
    return ", ".join(f"{i} {tok.convert_ids_to_tokens(i)!r}" for i in ids)


def turn_end_id(tok) -> int | None:
    """The first token the chat template writes after an assistant message's content (what a chat
    model emits to end its answer), or None where the template does not render such a turn."""
    marker = "opdkit-doctor-answer"
    try:
        text = tok.apply_chat_template([{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": marker}],
                                       tokenize=False)
    except (jinja2.TemplateError, ValueError, TypeError):  # a template that refuses this conversation: not checkable
        return None
    after = text[text.rfind(marker) + len(marker):] if marker in text else ""
    ids = tok(after, add_special_tokens=False).input_ids if after.strip() else []
    return ids[0] if ids else None


def special_tokens(cfg: Config, s_tok, t_tok, dirs: dict[str, Path]):
    out = []
    pad, s_eos = stop_ids(dirs["student"], s_tok)
    detail = (f"the student stops at {_names(s_tok, s_eos)}; pad {_names(s_tok, [pad])}"
              f"{' (= an EOS: masks, not the pad id, mark the ends)' if pad in s_eos else ''}")
    if "teacher" in dirs and cfg.teacher.tokenizer == "own":
        _, t_eos = stop_ids(dirs["teacher"], t_tok)
        end = xtok_end_id(cfg, t_tok, t_eos)
        detail += (f"; teacher.tokenizer=own: an answer's end is scored as the teacher's {_names(t_tok, [end])} (its "
                   f"stop ids {_names(t_tok, t_eos)})")
    elif "teacher" in dirs:
        _, t_eos = stop_ids(dirs["teacher"], t_tok)
        if not set(s_eos) & set(t_eos):
            out.append(Finding("special tokens", WARN, f"the student stops at {_names(s_tok, s_eos)} but the teacher's "
                               f"EOS is {_names(t_tok, t_eos)}: the teacher scores the student's end-of-answer token "
                               "as an ordinary token, so the signal at the end of every answer is off",
                               "use a teacher of the student's chat format, or give both the same eos_token_id in "
                               "generation_config.json"))
        else:
            detail += f"; the teacher's EOS {_names(t_tok, t_eos)}"
    if cfg.data.chat_template and getattr(s_tok, "chat_template", None) is not None:
        end = turn_end_id(s_tok)
        if end is not None and end not in s_eos:
            out.append(Finding("special tokens", WARN, f"the chat template ends an assistant turn with "
                               f"{_names(s_tok, [end])}, which is not among the ids the student stops at "
                               f"({_names(s_tok, s_eos)}): completions run on past the answer to "
                               "rollout.max_new_tokens",
                               f"add {end} to eos_token_id in the student's generation_config.json"))
        elif end is not None:
            detail += f"; the chat template ends a turn with {_names(s_tok, [end])} (a stop id)"
    if not out:
        out.append(Finding("special tokens", OK, detail))
    return None, out


def generation_config(cfg: Config, path: Path, role: str):
    """The checkpoint's sampling settings against what opdkit samples with."""
    f = Path(path) / "generation_config.json"
    try:
        gen = json.loads(f.read_text()) if f.is_file() else {}
    except json.JSONDecodeError as e:
        raise PairError(f"{f} is not valid JSON ({e})", "fix or remove the file") from None
    changers = {k: gen[k] for k in SAMPLING_CHANGERS if k in gen and gen[k] not in SAMPLING_CHANGERS[k]}
    replaced = ", ".join(f"{k} {gen[k]}" for k in REPLACED if gen.get(k) is not None)
    R, E = cfg.rollout, cfg.eval
    ours = (f"opdkit samples at rollout.temperature={R.temperature:g} / top_p={R.top_p:g} in training, "
            f"eval.temperature={E.temperature:g} / top_p={E.top_p:g} in opdkit eval, and nothing else")
    check = f"generation config ({role})"
    settings = ", ".join(f"{k}={v}" for k, v in changers.items())
    if role.startswith("teacher") and loss_table.samples_from(cfg.loss) != "teacher":
        return None, [Finding(check, OK, "not used: the teacher only scores" +
                              (f" (its {settings} would matter only where it samples: loss.name=sft, "
                               "sft_source=teacher)" if changers else ""))]
    if not changers:
        note = f"the checkpoint's {replaced} are replaced: " if replaced else "no sampling settings; "
        return None, [Finding(check, OK, note + ours)]
    return None, [Finding(check, WARN, f"{f} sets {settings}, which opdkit's engines do not apply: they set the "
                          f"checkpoint's generation config aside ({ours}), so opdkit's samples differ from "
                          "model.generate()'s or vLLM's with this checkpoint's defaults (the log-probs opdkit records "
                          "and recomputes are those of what it sampled)",
                          "nothing to do to sample as opdkit does; to compare with a tool that applies these defaults, "
                          "turn them off there or remove them from generation_config.json")]
