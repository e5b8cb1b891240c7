"""Data: read prompt tables (parquet or jsonl), normalise rows, select, format prompts.

Accepted row shapes (detected per row; column names also in any letter case, as the public files
spell them):

- plain / embedded: ``prompt`` (str), ``answer``; optional ``solution``, ``id``, ``source``.
- DAPO-Math style: ``prompt`` as a list of chat messages ``{role, content}`` (the user message
  carries DAPO's "Answer:" instruction around the problem); the ground truth in
  ``reward_model.ground_truth`` (or ``answer``); optional ``data_source``, ``extra_info.index``.
- problem style: ``problem`` (or ``question``), ``answer`` (else the last ``\\boxed{}`` of the
  solution); optional ``solution``, ``COT_Reason`` (a long verified reasoning trace), ``source``, an
  id (``id`` / ``uuid`` / ``unique_id`` / ``problem_idx``), ``year``. This covers MATH-500
  (problem/solution/answer/subject/level/unique_id), OpenThoughts-style OPSD rows
  (problem/solution/COT_Reason?/answer/source), AIME 2024 (``ID/Problem/Solution/Answer``, or
  id/problem/solution/answer/url/year) and AIME 2025 (``question/answer``, or problem/answer).

Every row becomes an ``Example``; a bad row fails with ``DataError`` naming the file, the row and
what was expected. ``select`` applies ``data.filters`` (answers matching a regex, excluded sources,
reference length in the student tokenizer's tokens, the longest share) and ``data.max_rows`` to
training rows; evaluation reads every row (``load_eval_examples``).

Prompt formats (``data.prompt_format``, and ``eval.prompt_format`` for evaluation): ``raw`` keeps
the prompt as given (text, or the chat messages); the others rebuild the user message from the
problem (``PROMPT_TEMPLATES``). ``data.chat_template`` renders the prompt with the tokenizer's chat
template (text prompts become one user message); without it a prompt is plain text (chat messages
are flattened to their contents). A privileged teacher's prompt (``privileged_prompt``) adds the
row's reference (``data.teacher_context``) as ``data.teacher_prompt`` says.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from opdkit.config import PROMPT_FORMATS, DataConfig

SUFFIXES = (".parquet", ".jsonl", ".json")
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
# DAPO-Math-17k's user message: ANSWER_LINE_PREFIX + problem + ANSWER_LINE_SUFFIX
ANSWER_LINE_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
ANSWER_LINE_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
# data.prompt_format -> the user message, ``{problem}`` filled in (raw: the prompt as stored)
PROMPT_TEMPLATES = {
    "boxed": "{problem}\n" + BOXED_INSTRUCTION,
    "answer_line": ANSWER_LINE_PREFIX + "{problem}" + ANSWER_LINE_SUFFIX,
    # the released OPSD collator's student message (siyan-zhao/OPSD data_collator.py, the release d75fcc7)
    "opsd_student": "Problem: {problem}\n\n" + BOXED_INSTRUCTION,
    # the released OPSD evaluator's message (eval/evaluate_math.py, same release)
    "opsd_eval": "{problem}\n\n" + BOXED_INSTRUCTION,
}
assert set(PROMPT_TEMPLATES) | {"raw"} == set(PROMPT_FORMATS)
# data.teacher_prompt=hint: the student's prompt, then this (``{reference}``: data.teacher_context's text)
PRIVILEGED_HINT = ("\n\nHere is a reference solution to this problem:\n{reference}\n\n"
                   "After understanding the reference solution, solve the problem yourself.")
# data.teacher_prompt=opsd: the first release's collator's teacher message (d75fcc7), its transition prompt included
OPSD_TEACHER_TEMPLATE = (
    "{problem}\n\nHere is a reference solution to this problem:\n{reference}\n"
    "\n\nAfter understanding the reference solution and the rationale behind each step, now articulate your own "
    "step-by-step reasoning that derives the same final answer to the problem below:\n"
    "\n" + BOXED_INSTRUCTION)
# data.teacher_prompt=opsd_delimited: the teacher message of the release whose collator takes student_thinking /
# teacher_thinking (siyan-zhao/OPSD data_collator.py at c181e5b, the math rows' branch; the seeded runs' recipe
# sets teacher_thinking): the reference between delimiters, then the transition that asks to re-derive it
OPSD_DELIMITED_TEACHER_TEMPLATE = (
    "Problem: {problem}\n\nHere is a reference solution to this problem:\n"
    "=== Reference Solution Begin ===\n{reference}\n=== Reference Solution End ===\n"
    "\n\nAfter reading the reference solution above, make sure you truly understand the reasoning behind each step "
    "\u2014 do not copy or paraphrase it. Now, using your own words and independent reasoning, derive the same final "
    "answer to the problem above. Think step by step, explore different approaches, and don't be afraid to backtrack "
    "or reconsider if something doesn't work out:\n"
    "\n" + BOXED_INSTRUCTION)
OPSD_TEACHER_TEMPLATES = {"opsd": OPSD_TEACHER_TEMPLATE, "opsd_delimited": OPSD_DELIMITED_TEACHER_TEMPLATE}


class DataError(ValueError):
    """A data file that cannot be used (the message names the file, row and expectation)."""


@dataclass(frozen=True)
class Example:
    id: str
    prompt: str | tuple[dict, ...]  # plain text, or chat messages
    answer: str
    solution: str = ""
    source: str = ""
    cot: str = ""  # a long verified reasoning trace (OpenThoughts-style COT_Reason), where the row has one
    teacher: str = ""  # the teacher this row names (data.teacher_column with several teachers; "" = the one teacher)
    row: int = field(default=-1, compare=False)  # its row in the data file (for error messages; not part of the row)

    @property
    def problem_text(self) -> str:
        """The problem alone: the text prompt, or the user messages without DAPO's instruction."""
        if isinstance(self.prompt, str):
            return self.prompt
        text = "\n\n".join(m["content"] for m in self.prompt if m.get("role") == "user")
        if text.startswith(ANSWER_LINE_PREFIX):
            text = text[len(ANSWER_LINE_PREFIX):]
        if text.endswith(ANSWER_LINE_SUFFIX):
            text = text[: -len(ANSWER_LINE_SUFFIX)]
        return text


def write_rows(rows: list[dict], path: str | Path) -> None:
    """Write rows as parquet through ``datasets`` (deterministic bytes for the same rows)."""
    from datasets import Dataset

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Dataset.from_list(rows).to_parquet(str(path))


def read_table(path: str | Path) -> list[dict]:
    """Rows of a parquet (through pyarrow), jsonl or JSON-array file, as dicts."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"data file {p} does not exist")
    if p.is_dir() or p.suffix not in SUFFIXES:
        raise DataError(f"data file {p}: expected a .parquet or .jsonl file (or a .json array of rows)")
    if p.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:  # one file: ParquetFile reads it as read_table does, without read_table's dataset layer (whose
            return pq.ParquetFile(p).read().to_pylist()  # import, pandas with it, costs a process ~0.35 s)
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"data file {p} is not a readable parquet file ({type(e).__name__}: {e})") from None
    text = p.read_text()
    if p.suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"data file {p}: not valid JSON ({e.msg}, line {e.lineno})") from None
        if not all(isinstance(r, dict) for r in rows):
            raise DataError(f"data file {p}: expected a JSON array of objects")
        return rows
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"data file {p}, line {n}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise DataError(f"data file {p}, line {n}: expected a JSON object per line")
        rows.append(row)
    return rows


def _last_boxed(text: str) -> str | None:
    from opdkit.grading import extract_boxed

    return extract_boxed(text)


def _answer_text(value, where: str) -> str | None:
    """Ground truth as text (None if missing); integral floats lose their ``.0``."""
    if value is None or value == "":
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DataError(f"{where}: the answer must be text or a number, got {type(value).__name__} {value!r}")
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    return str(value)


def _column(row: dict, *names: str) -> str | None:
    """The key of the first of ``names`` in ``row``: spelled as given, else in another letter case."""
    lower = {k.lower(): k for k in row if isinstance(k, str)}
    for name in names:
        if name in row:
            return name
        if name.lower() in lower:
            return lower[name.lower()]
    return None


def _value(row: dict, *names: str):
    key = _column(row, *names)
    return None if key is None else row[key]


def normalize_row(row: dict, index: int, path: str, teacher_column: str = "") -> Example:
    """The row as an ``Example``; ``teacher_column``: the column whose value names its teacher."""
    where = f"data file {path}, row {index}"
    teacher = row.get(teacher_column) if teacher_column else ""
    teacher = "" if teacher is None else str(teacher)
    extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    rid = next((str(v) for v in (_value(row, "id", "uuid", "unique_id", "problem_idx"), extra.get("index"))
                if v not in (None, "")), str(index))
    year = _value(row, "year")
    source = str(_value(row, "data_source") or _value(row, "source") or (year if year not in (None, "") else ""))
    problem_key = _column(row, "problem", "question")
    if problem_key is not None and _column(row, "prompt") is None:  # problem style (MATH-500, OpenThoughts, AIME)
        problem = row[problem_key]
        if not isinstance(problem, str) or not problem.strip():
            raise DataError(f"{where}: '{problem_key}' must be non-empty text")
        solution = str(_value(row, "solution") or "")
        answer = _answer_text(_value(row, "answer"), where) or _last_boxed(solution)
        if not answer:
            raise DataError(f"{where}: no 'answer' and no \\boxed{{}} answer in 'solution'")
        return Example(rid, problem, answer, solution, source, str(_value(row, "COT_Reason") or ""), teacher, index)
    if "prompt" not in row:
        raise DataError(f"{where} is in none of the known row shapes: expected a 'prompt' column (text, or chat "
                        "messages as in DAPO-Math-17k) or a 'problem' / 'question' column (MATH-500, OpenThoughts, "
                        f"AIME); found columns {sorted(row)}")
    prompt = row["prompt"]
    if isinstance(prompt, (list, tuple)):
        if not prompt or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                 and isinstance(m.get("content"), str) for m in prompt):
            raise DataError(f"{where}: 'prompt' is a list but not of {{role, content}} text messages")
        prompt = tuple({"role": m["role"], "content": m["content"]} for m in prompt)
    elif not isinstance(prompt, str):
        raise DataError(f"{where}: 'prompt' must be text or a list of chat messages, got {type(prompt).__name__}")
    if not (prompt.strip() if isinstance(prompt, str) else any(m["content"].strip() for m in prompt)):
        raise DataError(f"{where} (id {rid}): 'prompt' is empty (the student would be asked nothing); give the row "
                        "its problem, or drop the row")
    answer = _answer_text(row.get("answer"), where)
    rm = row.get("reward_model")
    if answer is None and isinstance(rm, dict):
        answer = _answer_text(rm.get("ground_truth"), where)
    if answer is None:
        raise DataError(f"{where}: no ground-truth answer (expected an 'answer' column or reward_model.ground_truth)")
    return Example(rid, prompt, answer, str(row.get("solution") or ""), source, str(_value(row, "COT_Reason") or ""),
                   teacher, index)


REFERENCES = ("solution", "cot")  # data.filters.reference, and what data.teacher_context draws on
TEACHER_REFERENCES = {"solution": ("solution",), "cot": ("cot",), "both": ("solution", "cot")}
_REFERENCE_COLUMNS = {"solution": "a 'solution' column", "cot": "a 'COT_Reason' column (a verified reasoning trace)"}


def reference_text(ex: Example, which: str) -> str:
    """The row's reference of kind ``which``: its solution, or its COT_Reason trace."""
    return {"solution": ex.solution, "cot": ex.cot}[which]


def token_counter(tokenizer) -> Callable[[list[str]], list[int]]:
    """Token counts of texts under ``tokenizer`` (no special tokens added), for the length filters."""
    def count(texts: list[str]) -> list[int]:
        return [len(ids) for ids in tokenizer(texts, add_special_tokens=False).input_ids] if texts else []

    return count


def needs_tokens(data: DataConfig) -> bool:
    """Whether ``select`` counts tokens (and so needs a token counter) under these filters."""
    f = data.filters
    return f.min_reference_tokens > 0 or f.top_reference_fraction < 1.0


def select(examples: list[Example], data: DataConfig,
           count_tokens: Callable[[list[str]], list[int]] | None = None) -> list[Example]:
    """Apply ``data.filters`` and ``data.max_rows``, in this order, the table's order kept:

    1. answers whose stripped text fully matches ``answer_regex`` (``-?\\d{1,6}``: "34", "-5";
       not "1,000", "+5", "3.0", "$34$");
    2. sources not in ``exclude_sources``;
    3. references (``reference``: solution or COT_Reason trace) of at least ``min_reference_tokens``
       tokens (``count_tokens``: texts -> counts, e.g. ``token_counter(the student's tokenizer)``);
    4. of those, the ``ceil(top_reference_fraction * n)`` rows with the longest references (ties: the
       earlier row first), i.e. 0.5 keeps the upper half;
    5. the first ``max_rows``.
    """
    f = data.filters
    pattern = re.compile(f.answer_regex) if f.answer_regex else None
    excluded = set(f.exclude_sources)
    rows = [ex for ex in examples
            if (pattern is None or pattern.fullmatch(ex.answer.strip())) and ex.source not in excluded]
    if needs_tokens(data):
        if count_tokens is None:
            raise DataError("data.filters.min_reference_tokens / top_reference_fraction count reference lengths in "
                            "tokens: load the rows with the student's tokenizer (load_examples(..., tokenizer=...))")
        lengths = count_tokens([reference_text(ex, f.reference) for ex in rows])
        keep = [i for i, n in enumerate(lengths) if n >= f.min_reference_tokens]
        if f.top_reference_fraction < 1.0:
            n_keep = math.ceil(f.top_reference_fraction * len(keep))
            keep = sorted(sorted(keep, key=lambda i: -lengths[i])[:n_keep])  # sorted() is stable: ties keep order
        rows = [rows[i] for i in keep]
    return rows[: data.max_rows] if data.max_rows else rows


def check_teachers(examples: list[Example], path, column: str, teachers: tuple[str, ...]) -> None:
    """Every selected row names one of ``teachers`` in ``column`` (several teachers: ``teachers``,
    ``data.teacher_column``); else a ``DataError`` naming the file, the first such row and the names."""
    known = set(teachers)
    bad = [ex for ex in examples if ex.teacher not in known]
    if bad:
        ex = bad[0]
        named = f"names teacher {ex.teacher!r}" if ex.teacher else f"names no teacher (no value in column {column!r})"
        raise DataError(f"data file {path}, row {ex.row} (id {ex.id}) {named}, which is not one of the teachers of "
                        f"params key 'teachers': {', '.join(teachers)} ({len(bad)} of {len(examples)} selected rows "
                        f"are like it); give each row one of those names in column {column!r} (data.teacher_column)")


def _read_examples(path: str | Path, teacher_column: str = "", need_column: bool = False) -> list[Example]:
    """Every row of the file; ``need_column``: the file must have ``teacher_column``."""
    rows = read_table(path)
    if not rows:
        raise DataError(f"data file {path} has no rows")
    if need_column and not any(teacher_column in r for r in rows):
        raise DataError(f"data file {path} has no column {teacher_column!r} (data.teacher_column: the column naming "
                        f"each row's teacher); its columns: {sorted(rows[0])}")
    return [normalize_row(r, i, str(path), teacher_column) for i, r in enumerate(rows)]


def load_examples(path: str | Path, data: DataConfig, *, require: tuple[str, ...] = (),
                  tokenizer=None, teachers: tuple[str, ...] | None = None) -> list[Example]:
    """Training rows: read, normalise and select (``tokenizer``: the student's, when the filters count
    tokens); an empty result, or a selected row without a reference named in ``require``
    ("solution", "cot"), is an error that says why. ``data.teacher_column`` (several teachers) is
    read where the file has it; with ``teachers`` (the training data) the file must have it and every
    selected row must name one of them."""
    column = data.teacher_column if teachers is not None else ""
    examples = _read_examples(path, data.teacher_column, need_column=bool(column))
    chosen = select(examples, data, token_counter(tokenizer) if tokenizer is not None else None)
    if not chosen:
        raise DataError(f"data file {path}: all {len(examples)} rows were removed by data.filters / data.max_rows")
    for which in require:
        missing = [ex.id for ex in chosen if not reference_text(ex, which).strip()]
        if missing:
            raise DataError(f"data file {path}: this run needs {_REFERENCE_COLUMNS[which]} in every row, but "
                            f"{len(missing)} of {len(chosen)} selected rows have none (first: id {missing[0]}); "
                            f"drop them with -S data.filters.reference={which} -S data.filters.min_reference_tokens=1")
    if column:
        check_teachers(chosen, path, column, teachers)
    return chosen


def load_eval_examples(paths: list[str | Path]) -> list[Example]:
    """Evaluation rows: every row of each file (``data.filters`` select training rows only). With
    several files (e.g. AIME 2024 and AIME 2025), ids become ``<file stem>/<id>`` so that questions
    stay apart, and a row without a source takes its file's stem (the eval JSON's per-source parts)."""
    if len(paths) == 1:
        return _read_examples(paths[0])
    out = []
    for path in paths:
        stem = Path(path).stem
        out += [Example(f"{stem}/{ex.id}", ex.prompt, ex.answer, ex.solution, ex.source or stem, ex.cot)
                for ex in _read_examples(path)]
    return out


def fingerprint(examples: list[Example]) -> str:
    """sha256 over the selected examples (what a run trained on, independent of file format)."""
    h = hashlib.sha256()
    for ex in examples:  # a row's teacher counts where it names one (one teacher: as before)
        fields = ([ex.id, ex.prompt, ex.answer, ex.solution, ex.source] + ([ex.cot] if ex.cot else [])
                  + ([ex.teacher] if ex.teacher else []))
        h.update(json.dumps(fields, sort_keys=True).encode())
    return h.hexdigest()


def _fill(template: str, **fields: str) -> str:
    """``template`` with ``{name}`` replaced by ``fields[name]`` in one pass (the texts may hold braces)."""
    return re.sub(r"\{(" + "|".join(fields) + r")\}", lambda m: fields[m.group(1)], template)


def _system_messages(ex: Example) -> list[dict]:
    return [dict(m) for m in ex.prompt if m.get("role") == "system"] if not isinstance(ex.prompt, str) else []


def _as_prompt(messages: list[dict], data: DataConfig) -> str | list[dict]:
    return messages if data.chat_template else "\n\n".join(m["content"] for m in messages)


def format_prompt(ex: Example, data: DataConfig) -> str | list[dict]:
    """The prompt the model sees: chat messages with ``data.chat_template``, else text."""
    if data.prompt_format == "raw":
        if isinstance(ex.prompt, str):
            return [{"role": "user", "content": ex.prompt}] if data.chat_template else ex.prompt
        return _as_prompt([dict(m) for m in ex.prompt], data)
    text = _fill(PROMPT_TEMPLATES[data.prompt_format], problem=ex.problem_text)
    return _as_prompt(_system_messages(ex) + [{"role": "user", "content": text}], data)


def teacher_reference(ex: Example, data: DataConfig) -> str:
    """What a privileged teacher is shown (``data.teacher_context``): the solution, the COT_Reason
    trace, or both (the solution, a blank line, the trace)."""
    return "\n\n".join(reference_text(ex, which) for which in TEACHER_REFERENCES[data.teacher_context])


def privileged_prompt(ex: Example, data: DataConfig) -> str | list[dict]:
    """A privileged teacher's prompt (OPSD): ``hint``: the student's prompt with ``PRIVILEGED_HINT``
    after its last user message (text prompts of the embedded default, no chat template: `` [ref]``);
    ``opsd`` / ``opsd_delimited``: a released collator's teacher message built from the problem
    (``OPSD_TEACHER_TEMPLATES``)."""
    reference = teacher_reference(ex, data)
    if data.teacher_prompt in OPSD_TEACHER_TEMPLATES:
        text = _fill(OPSD_TEACHER_TEMPLATES[data.teacher_prompt], problem=ex.problem_text, reference=reference)
        return _as_prompt(_system_messages(ex) + [{"role": "user", "content": text}], data)
    formatted = format_prompt(ex, data)
    if isinstance(formatted, str):
        plain = data.prompt_format == "raw" and isinstance(ex.prompt, str)
        return formatted + (f" [{reference}]" if plain else _fill(PRIVILEGED_HINT, reference=reference))
    users = [i for i, m in enumerate(formatted) if m["role"] == "user"]
    last = users[-1] if users else len(formatted) - 1
    hint = _fill(PRIVILEGED_HINT, reference=reference)
    return [dict(m, content=m["content"] + hint) if i == last else m for i, m in enumerate(formatted)]


def thinking(data: DataConfig, privileged: bool = False) -> bool:
    """The chat template's ``enable_thinking`` for the student's prompts (``data.enable_thinking``) or
    a privileged teacher's (``data.teacher_enable_thinking``)."""
    return data.teacher_enable_thinking if privileged else data.enable_thinking


def render_chat(tokenizer, messages: list[dict], enable_thinking: bool) -> str:
    """``messages`` rendered by the tokenizer's chat template, with the generation prompt and
    ``enable_thinking`` (a template that does not read it renders the same text either way)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError("data.chat_template is true but the tokenizer has no chat template; "
                        "set data.chat_template=false (prompts are then plain text)")
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                         enable_thinking=enable_thinking)


def render_prompt(ex: Example, tokenizer, data: DataConfig, privileged: bool = False) -> str:
    """The prompt's text as the model reads it: chat messages rendered by the chat template
    (``thinking``: its enable_thinking), else the plain text; ``privileged``: a privileged teacher's."""
    formatted = privileged_prompt(ex, data) if privileged else format_prompt(ex, data)
    return render_chat(tokenizer, formatted, thinking(data, privileged)) if isinstance(formatted, list) else formatted


def encode_prompt(ex: Example, tokenizer, data: DataConfig, privileged: bool = False) -> list[int]:
    """Token ids of the formatted prompt; ``privileged``: the privileged teacher's prompt (OPSD)."""
    formatted = privileged_prompt(ex, data) if privileged else format_prompt(ex, data)
    if isinstance(formatted, list):
        # Rendered to text, then tokenized without extra special tokens (the template has them);
        # this sidesteps apply_chat_template(tokenize=True), which returns a BatchEncoding in transformers 5.
        text = render_chat(tokenizer, formatted, thinking(data, privileged))
        return list(tokenizer(text, add_special_tokens=False).input_ids)
    return list(tokenizer(formatted).input_ids)


# --- the data order (data.order) ------------------------------------------------------------------------


def hf_trainer_permutation(seed: int, n_rows: int, epoch: int) -> list[int]:
    """Epoch ``epoch``'s row order in one process of a Hugging Face ``Trainer`` whose torch seed is
    ``seed``: accelerate's ``SeedableRandomSampler`` reseeds its generator with seed + epoch at each
    epoch, then ``RandomSampler`` draws ``torch.randperm(n_rows)`` from it."""
    import torch

    return torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def hf_trainer_rows(seed: int, n_rows: int, start: int, count: int, processes: int = 1, device_batch: int = 0,
                    rank_seeds: str = "seed") -> list[int]:
    """Rows ``start .. start+count-1`` of the stream a Hugging Face ``Trainer`` trains on, ``count``
    rows a step (``data.order=hf_trainer``, ``data.hf_order``; ``start`` a multiple of ``count``).

    Step s of W = ``processes`` processes, each taking b = ``device_batch`` rows a micro-batch and
    a = count / (W b) micro-batches a step (gradient accumulation): process r's j-th micro-batch of
    the step is batch u = (s a + j) W + r of its own epoch order (accelerate's ``BatchSamplerShard``
    deals batch u to process u mod W), i.e. rows u b .. u b + b - 1 of ``hf_trainer_permutation(seed_r,
    n_rows, epoch)``; seed_r = ``seed`` on every process (``rank_seeds=seed``) or r
    (``vllm_rank``). The step's rows are listed micro-batch by micro-batch, process by process. An
    epoch holds n_rows // count full steps: where its rows do not fill a last step, the Trainer
    trains them as a shorter step and this stream starts the next epoch's order instead."""
    b = device_batch or count // processes
    if count % (processes * b) or start % count:
        raise ValueError(f"data.order=hf_trainer: a step of {count} rows (rollout.prompts_per_step) must be a whole "
                         f"number of micro-batches of data.hf_order.device_batch={b} rows on each of "
                         f"data.hf_order.processes={processes} processes (and start at a step boundary, row {start})")
    if n_rows < count:
        raise DataError(f"data.order=hf_trainer: {n_rows} rows do not fill one step of {count} "
                        "(rollout.prompts_per_step)")
    a, per_epoch = count // (processes * b), n_rows // count
    perms: dict[tuple[int, int], list[int]] = {}
    out = []
    for pos in range(start, start + count):
        step, i = divmod(pos, count)
        epoch, s = divmod(step, per_epoch)
        j, rest = divmod(i, processes * b)
        r, k = divmod(rest, b)
        seed_r = seed if rank_seeds == "seed" else r
        if (seed_r, epoch) not in perms:
            perms[seed_r, epoch] = hf_trainer_permutation(seed_r, n_rows, epoch)
        out.append(perms[seed_r, epoch][((s * a + j) * processes + r) * b + k])
    return out


def prompt_indices(seed: int, n_rows: int, start: int, count: int, order: str = "shuffled", hf_order=None) -> list[int]:
    """Rows ``start .. start+count-1`` of the data stream: a fresh seeded shuffle per epoch
    (``data.order=shuffled``), the table's order, epoch after epoch (``stored``), or the Hugging Face
    Trainer's from the seed (``hf_trainer``, a step of ``count`` rows: ``hf_trainer_rows``; ``hf_order``
    the params' ``data.hf_order``, default its defaults)."""
    if order == "hf_trainer":
        from opdkit.config import HFOrderConfig

        h = hf_order or HFOrderConfig()
        return hf_trainer_rows(seed, n_rows, start, count, h.processes, h.device_batch, h.rank_seeds)
    if order == "stored":
        return [pos % n_rows for pos in range(start, start + count)]
    out, perms = [], {}
    for pos in range(start, start + count):
        epoch, i = divmod(pos, n_rows)
        if epoch not in perms:
            perms[epoch] = random.Random(f"{seed}/epoch/{epoch}").sample(range(n_rows), n_rows)
        out.append(perms[epoch][i])
    return out
