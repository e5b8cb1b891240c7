"""Data: read prompt tables (parquet via ``datasets``, or jsonl), normalise rows, select, format.

Accepted row shapes (detected per file):

- plain / embedded: ``prompt`` (str), ``answer``; optional ``solution``, ``id``, ``source``.
- DAPO-Math style: ``prompt`` as a list of chat messages ``{role, content}``; the ground truth in
  ``reward_model.ground_truth`` (or ``answer``); optional ``data_source``.
- OpenThoughts style: ``problem``, ``solution``; ``answer`` optional (else the last ``\\boxed{}``
  of the solution).

Every row becomes an ``Example``; a bad file fails with ``DataError`` naming the file, the row and
what was expected.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from opdkit.config import DataConfig

SUFFIXES = (".parquet", ".jsonl", ".json")
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
ANSWER_LINE_INSTRUCTION = (
    "Solve the following math problem step by step. The last line of your response should be of the "
    'form "Answer: $Answer" (without quotes) where $Answer is the answer to the problem.'
)


class DataError(ValueError):
    """A data file that cannot be used (the message names the file, row and expectation)."""


@dataclass(frozen=True)
class Example:
    id: str
    prompt: str | tuple[dict, ...]  # plain text, or chat messages
    answer: str
    solution: str = ""
    source: str = ""

    @property
    def problem_text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        return "\n".join(m["content"] for m in self.prompt if m.get("role") == "user")


def write_rows(rows: list[dict], path: str | Path) -> None:
    """Write rows as parquet through ``datasets`` (deterministic bytes for the same rows)."""
    from datasets import Dataset

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Dataset.from_list(rows).to_parquet(str(path))


def read_table(path: str | Path) -> list[dict]:
    """Rows of a parquet (through ``datasets``) or jsonl file, as dicts."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"data file {p} does not exist")
    if p.is_dir() or p.suffix not in SUFFIXES:
        raise DataError(f"data file {p}: expected a .parquet or .jsonl file")
    if p.suffix == ".parquet":
        from datasets import Dataset

        try:
            ds = Dataset.from_parquet(str(p), keep_in_memory=True)
        except Exception as e:  # pyarrow raises several types for a non-parquet file
            raise DataError(f"data file {p} is not a readable parquet file ({type(e).__name__}: {e})") from None
        return ds.to_list()
    rows = []
    with p.open() as f:
        for n, line in enumerate(f, 1):
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


def normalize_row(row: dict, index: int, path: str) -> Example:
    where = f"data file {path}, row {index}"
    rid = str(row.get("id", row.get("extra_info", {}).get("index", index) if isinstance(row.get("extra_info"), dict) else index))
    source = str(row.get("data_source", row.get("source", "")) or "")
    if "problem" in row and "prompt" not in row:  # OpenThoughts style
        solution = str(row.get("solution") or "")
        answer = row.get("answer")
        if answer in (None, ""):
            answer = _last_boxed(solution)
        if answer in (None, ""):
            raise DataError(f"{where}: no 'answer' and no \\boxed{{}} answer in 'solution'")
        return Example(rid, str(row["problem"]), str(answer), solution, source)
    if "prompt" not in row:
        raise DataError(f"{where}: expected a 'prompt' column (text or chat messages) or a 'problem' column; "
                        f"found {sorted(row)}")
    prompt = row["prompt"]
    if isinstance(prompt, (list, tuple)):
        if not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
            raise DataError(f"{where}: 'prompt' is a list but not of {{role, content}} messages")
        prompt = tuple({"role": m["role"], "content": m["content"]} for m in prompt)
    elif not isinstance(prompt, str):
        raise DataError(f"{where}: 'prompt' must be text or a list of chat messages, got {type(prompt).__name__}")
    answer = row.get("answer")
    rm = row.get("reward_model")
    if answer in (None, "") and isinstance(rm, dict):
        answer = rm.get("ground_truth")
    if answer in (None, ""):
        raise DataError(f"{where}: no ground-truth answer (expected an 'answer' column or reward_model.ground_truth)")
    return Example(rid, prompt, str(answer), str(row.get("solution") or ""), source)


_INT = re.compile(r"^[+-]?\d+$")


def select(examples: list[Example], data: DataConfig) -> list[Example]:
    """Apply the selection filters of ``data.filters`` and ``data.max_rows`` (order preserved)."""
    f = data.filters
    out = [
        ex for ex in examples
        if (not f.integer_answers or _INT.match(ex.answer.strip().replace(",", "")))
        and len(ex.solution) >= f.min_solution_chars
        and ex.source not in f.exclude_sources
    ]
    return out[: data.max_rows] if data.max_rows else out


def load_examples(path: str | Path, data: DataConfig, *, require_solution: bool = False) -> list[Example]:
    """Read, normalise and select; an empty result is an error that says why."""
    rows = read_table(path)
    if not rows:
        raise DataError(f"data file {path} has no rows")
    examples = [normalize_row(r, i, str(path)) for i, r in enumerate(rows)]
    if require_solution and not any(ex.solution for ex in examples):
        raise DataError(f"data file {path}: this run needs reference solutions (a 'solution' column)")
    chosen = select(examples, data)
    if not chosen:
        raise DataError(f"data file {path}: all {len(examples)} rows were removed by data.filters / data.max_rows")
    return chosen


def fingerprint(examples: list[Example]) -> str:
    """sha256 over the selected examples (what a run trained on, independent of file format)."""
    h = hashlib.sha256()
    for ex in examples:
        h.update(json.dumps([ex.id, ex.prompt, ex.answer, ex.solution, ex.source], sort_keys=True).encode())
    return h.hexdigest()


def format_prompt(ex: Example, data: DataConfig) -> str | list[dict]:
    """The prompt text (or chat messages) the model sees, per ``data.prompt_format``."""
    if not isinstance(ex.prompt, str):
        return list(ex.prompt)
    if data.prompt_format == "raw":
        return ex.prompt
    instruction = BOXED_INSTRUCTION if data.prompt_format == "boxed" else ANSWER_LINE_INSTRUCTION
    text = f"{ex.prompt}\n{instruction}" if data.prompt_format == "boxed" else f"{instruction}\n\n{ex.prompt}"
    return [{"role": "user", "content": text}] if data.chat_template else text


def encode_prompt(ex: Example, tokenizer, data: DataConfig, privileged: bool = False) -> list[int]:
    """Token ids of the formatted prompt; ``privileged`` adds the reference solution (OPSD teacher)."""
    formatted = format_prompt(ex, data)
    if privileged:
        hint = f"\nA reference solution:\n{ex.solution}\nNow solve it yourself.\n" if data.prompt_format != "raw" else f" [{ex.solution}]"
        if isinstance(formatted, list):
            formatted = formatted[:-1] + [{**formatted[-1], "content": formatted[-1]["content"] + hint}]
        else:
            formatted = formatted + hint
    if isinstance(formatted, list):
        if tokenizer.chat_template is None:
            raise DataError("data.chat_template is true (or the prompts are chat messages) but the tokenizer "
                            "has no chat template; set data.chat_template=false and use text prompts")
        enc = tokenizer.apply_chat_template(formatted, add_generation_prompt=True, tokenize=True)
        ids = enc["input_ids"] if hasattr(enc, "keys") else enc  # transformers 5 returns a BatchEncoding
        return list(ids[0] if ids and isinstance(ids[0], list) else ids)
    return list(tokenizer(formatted).input_ids)
