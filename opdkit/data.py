"""Data: read prompt tables (parquet or jsonl), normalise rows, select, format prompts.

Accepted row shapes (detected per row):

- plain / embedded: ``prompt`` (str), ``answer``; optional ``solution``, ``id``, ``source``.
- DAPO-Math style: ``prompt`` as a list of chat messages ``{role, content}`` (the user message
  carries DAPO's "Answer:" instruction around the problem); the ground truth in
  ``reward_model.ground_truth`` (or ``answer``); optional ``data_source``, ``extra_info.index``.
- MATH-500 / OpenThoughts style: ``problem``, ``solution``; ``answer`` optional (else the last
  ``\\boxed{}`` of the solution); optional ``source``, ``uuid`` / ``unique_id``.

Every row becomes an ``Example``; a bad row fails with ``DataError`` naming the file, the row and
what was expected. ``select`` applies ``data.filters`` (integer answers, minimum reference-solution
length, excluded sources) and ``data.max_rows``.

Prompt formats (``data.prompt_format``): ``raw`` keeps the prompt as given (text, or the chat
messages); ``boxed`` asks for the final answer in ``\\boxed{}`` after the problem; ``answer_line``
wraps the problem in DAPO's "Answer:" instruction. ``data.chat_template`` renders the prompt with
the tokenizer's chat template (text prompts become one user message); without it a prompt is
plain text (chat messages are flattened to their contents).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from opdkit.config import DataConfig

SUFFIXES = (".parquet", ".jsonl", ".json")
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
# DAPO-Math-17k's user message: ANSWER_LINE_PREFIX + problem + ANSWER_LINE_SUFFIX
ANSWER_LINE_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
ANSWER_LINE_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'
PRIVILEGED_HINT = ("\n\nHere is a reference solution to this problem:\n{solution}\n\n"
                   "After understanding the reference solution, solve the problem yourself.")


class DataError(ValueError):
    """A data file that cannot be used (the message names the file, row and expectation)."""


@dataclass(frozen=True)
class Example:
    id: str
    prompt: str | tuple[dict, ...]  # plain text, or chat messages
    answer: str
    solution: str = ""
    source: str = ""
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

        try:
            return pq.read_table(p).to_pylist()
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


def normalize_row(row: dict, index: int, path: str, teacher_column: str = "") -> Example:
    """The row as an ``Example``; ``teacher_column``: the column whose value names its teacher."""
    where = f"data file {path}, row {index}"
    teacher = row.get(teacher_column) if teacher_column else ""
    teacher = "" if teacher is None else str(teacher)
    extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    rid = next((str(v) for v in (row.get("id"), row.get("uuid"), row.get("unique_id"), extra.get("index"))
                if v not in (None, "")), str(index))
    source = str(row.get("data_source") or row.get("source") or "")
    if "problem" in row and "prompt" not in row:  # OpenThoughts style
        if not isinstance(row["problem"], str) or not row["problem"].strip():
            raise DataError(f"{where}: 'problem' must be non-empty text")
        solution = str(row.get("solution") or "")
        answer = _answer_text(row.get("answer"), where) or _last_boxed(solution)
        if not answer:
            raise DataError(f"{where}: no 'answer' and no \\boxed{{}} answer in 'solution'")
        return Example(rid, row["problem"], answer, solution, source, teacher, index)
    if "prompt" not in row:
        raise DataError(f"{where} is in none of the known row shapes: expected a 'prompt' column (text, or chat "
                        "messages as in DAPO-Math-17k) or a 'problem' column (MATH-500 / OpenThoughts); "
                        f"found columns {sorted(row)}")
    prompt = row["prompt"]
    if isinstance(prompt, (list, tuple)):
        if not prompt or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                                 for m in prompt):
            raise DataError(f"{where}: 'prompt' is a list but not of {{role, content}} text messages")
        prompt = tuple({"role": m["role"], "content": m["content"]} for m in prompt)
    elif not isinstance(prompt, str):
        raise DataError(f"{where}: 'prompt' must be text or a list of chat messages, got {type(prompt).__name__}")
    answer = _answer_text(row.get("answer"), where)
    rm = row.get("reward_model")
    if answer is None and isinstance(rm, dict):
        answer = _answer_text(rm.get("ground_truth"), where)
    if answer is None:
        raise DataError(f"{where}: no ground-truth answer (expected an 'answer' column or reward_model.ground_truth)")
    return Example(rid, prompt, answer, str(row.get("solution") or ""), source, teacher, index)


_INT = re.compile(r"^[+-]?\d+$")
_BOXED_WRAP = re.compile(r"^\\boxed\{(.*)\}$")


def is_integer_answer(answer: str) -> bool:
    """``34``, ``-5``, ``1,000``, ``1{,}000``, ``$34$``, ``\\boxed{34}``: yes; ``3.5``, ``\\frac{1}{2}``: no."""
    a = answer.strip().strip("$").strip()
    m = _BOXED_WRAP.match(a)
    if m:
        a = m.group(1).strip()
    a = a.replace("{,}", "").replace("\\,", "").replace(",", "").replace(" ", "")
    return bool(_INT.match(a))


def select(examples: list[Example], data: DataConfig) -> list[Example]:
    """Apply the selection filters of ``data.filters`` and ``data.max_rows`` (order preserved)."""
    f = data.filters
    excluded = set(f.exclude_sources)
    out = [
        ex for ex in examples
        if (not f.integer_answers or is_integer_answer(ex.answer))
        and len(ex.solution.strip()) >= f.min_solution_chars
        and ex.source not in excluded
    ]
    return out[: data.max_rows] if data.max_rows else out


def check_teachers(examples: list[Example], path, column: str, teachers: tuple[str, ...]) -> None:
    """Every selected row names one of ``teachers`` in ``column`` (several teachers: ``teachers``,
    ``data.teacher_column``); else a ``DataError`` naming the file, the first such row and the names."""
    known = set(teachers)
    bad = [ex for ex in examples if ex.teacher not in known]
    if bad:
        ex = bad[0]
        named = f"names teacher {ex.teacher!r}" if ex.teacher else f"names no teacher (no value in column {column!r})"
        raise DataError(f"data file {path}, row {ex.row} (id {ex.id}) {named}, which is not one of the teachers of "
                        f"params key 'teachers': {', '.join(teachers)} ({len(bad)} of {len(examples)} selected rows are "
                        f"like it); give each row one of those names in column {column!r} (data.teacher_column)")


def load_examples(path: str | Path, data: DataConfig, *, require_solution: bool = False,
                  teachers: tuple[str, ...] | None = None) -> list[Example]:
    """Read, normalise and select; an empty result, or (``require_solution``) a selected row with
    no reference solution, is an error that says why. ``data.teacher_column`` (several teachers) is
    read where the file has it; with ``teachers`` (the training data) the file must have it and every
    selected row must name one of them."""
    rows = read_table(path)
    if not rows:
        raise DataError(f"data file {path} has no rows")
    column = data.teacher_column if teachers is not None else ""
    if column and not any(column in r for r in rows):
        raise DataError(f"data file {path} has no column {column!r} (data.teacher_column: the column naming each row's "
                        f"teacher); its columns: {sorted(rows[0])}")
    examples = [normalize_row(r, i, str(path), data.teacher_column) for i, r in enumerate(rows)]
    chosen = select(examples, data)
    if not chosen:
        raise DataError(f"data file {path}: all {len(examples)} rows were removed by data.filters / data.max_rows")
    if require_solution:
        missing = [ex.id for ex in chosen if not ex.solution.strip()]
        if missing:
            raise DataError(f"data file {path}: this run needs reference solutions (a 'solution' column), but "
                            f"{len(missing)} of {len(chosen)} selected rows have none (first: id {missing[0]}); "
                            "drop them with -S data.filters.min_solution_chars=1")
    if column:
        check_teachers(chosen, path, column, teachers)
    return chosen


def fingerprint(examples: list[Example]) -> str:
    """sha256 over the selected examples (what a run trained on, independent of file format)."""
    h = hashlib.sha256()
    for ex in examples:  # a row's teacher counts where it names one (one teacher: as before)
        fields = [ex.id, ex.prompt, ex.answer, ex.solution, ex.source] + ([ex.teacher] if ex.teacher else [])
        h.update(json.dumps(fields, sort_keys=True).encode())
    return h.hexdigest()


def format_prompt(ex: Example, data: DataConfig) -> str | list[dict]:
    """The prompt the model sees: chat messages with ``data.chat_template``, else text."""
    if data.prompt_format == "raw":
        if isinstance(ex.prompt, str):
            messages = [{"role": "user", "content": ex.prompt}]
        else:
            messages = [dict(m) for m in ex.prompt]
    else:
        problem = ex.problem_text
        text = (f"{problem}\n{BOXED_INSTRUCTION}" if data.prompt_format == "boxed"
                else f"{ANSWER_LINE_PREFIX}{problem}{ANSWER_LINE_SUFFIX}")
        system = [dict(m) for m in ex.prompt if m.get("role") == "system"] if not isinstance(ex.prompt, str) else []
        messages = system + [{"role": "user", "content": text}]
    if data.chat_template:
        return messages
    if data.prompt_format == "raw" and isinstance(ex.prompt, str):
        return ex.prompt
    return "\n\n".join(m["content"] for m in messages)


def encode_prompt(ex: Example, tokenizer, data: DataConfig, privileged: bool = False) -> list[int]:
    """Token ids of the formatted prompt; ``privileged`` adds the reference solution (OPSD teacher)."""
    formatted = format_prompt(ex, data)
    if privileged:
        hint = f" [{ex.solution}]" if data.prompt_format == "raw" and isinstance(ex.prompt, str) and not data.chat_template \
            else PRIVILEGED_HINT.format(solution=ex.solution)
        if isinstance(formatted, list):
            last = max(i for i, m in enumerate(formatted) if m["role"] == "user") if any(
                m["role"] == "user" for m in formatted) else len(formatted) - 1
            formatted = [dict(m, content=m["content"] + hint) if i == last else m for i, m in enumerate(formatted)]
        else:
            formatted = formatted + hint
    if isinstance(formatted, list):
        if getattr(tokenizer, "chat_template", None) is None:
            raise DataError("data.chat_template is true but the tokenizer has no chat template; "
                            "set data.chat_template=false (prompts are then plain text)")
        # Rendered to text, then tokenized without extra special tokens (the template has them);
        # this sidesteps apply_chat_template(tokenize=True), which returns a BatchEncoding in transformers 5.
        text = tokenizer.apply_chat_template(formatted, add_generation_prompt=True, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False).input_ids)
    return list(tokenizer(formatted).input_ids)
