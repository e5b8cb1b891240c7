"""The embedded synthetic math task: seeded multi-step arithmetic with chain-of-thought solutions.

A problem reads ``Compute 47+5-29+8.``; its reference solution works left to right, one
operation per sentence, and ends in a boxed answer: `` 47+5=52. 52-29=23. 23+8=31. \\boxed{31}``. Every intermediate
value stays in 0..99, so each step is a 2-digit addition (often with a carry) or subtraction.

``carry_dropped_solution`` writes the same solution with every addition's carries dropped
(47+5=42): the planted systematic error of the embedded student, which a teacher can correct on
the student's own samples.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

COLUMNS = ("id", "prompt", "solution", "answer")
SUBTRACT_P = 0.3  # additions are more common: about half the problems then need a carry


@dataclass(frozen=True)
class Problem:
    first: int
    ops: tuple[tuple[str, int], ...]  # (op, operand) applied left to right

    @property
    def prompt(self) -> str:
        return "Compute " + str(self.first) + "".join(f"{op}{x}" for op, x in self.ops) + "."


def add_without_carry(a: int, b: int) -> int:
    """Digit-wise sum mod 10 (every carry dropped): 47+5 -> 42, 58+67 -> 15.

    Defined for non-negative operands; with a negative one (reachable only after earlier dropped
    carries) it is the plain sum.
    """
    if a < 0 or b < 0:
        return a + b
    out, place = 0, 1
    while a or b:
        out += ((a % 10 + b % 10) % 10) * place
        a, b, place = a // 10, b // 10, place * 10
    return out


def solve(p: Problem, drop_carries: bool = False) -> tuple[str, int]:
    """The chain-of-thought solution text and the final value (with or without the planted error)."""
    value, parts = p.first, []
    for op, x in p.ops:
        if op == "+":
            new = add_without_carry(value, x) if drop_carries else value + x
        else:
            new = value - x
        parts.append(f" {value}{op}{x}={new}.")
        value = new
    return "".join(parts) + f" \\boxed{{{value}}}", value


def carry_dropped_solution(p: Problem) -> str:
    return solve(p, drop_carries=True)[0]


def sample_problem(rng: random.Random, min_ops: int, max_ops: int) -> Problem:
    value = rng.randint(10, 99)
    first, ops = value, []
    for _ in range(rng.randint(min_ops, max_ops)):
        # Keep every intermediate value in 0..99: add at most 99-value, subtract at most value.
        if value >= 95 or (value > 5 and rng.random() < SUBTRACT_P):
            x = rng.randint(1, value)
            ops.append(("-", x))
            value -= x
        else:
            x = rng.randint(1, 99 - value)
            ops.append(("+", x))
            value += x
    return Problem(first, tuple(ops))


def make_splits(seed: int, n_train: int, n_eval: int, min_ops: int = 2,
                max_ops: int = 2) -> tuple[list[dict], list[dict]]:
    """Disjoint train/eval rows ``{id, prompt, solution, answer}``; identical for the same arguments."""
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[dict] = []
    while len(rows) < n_train + n_eval:
        p = sample_problem(rng, min_ops, max_ops)
        if p.prompt in seen:
            continue
        seen.add(p.prompt)
        solution, answer = solve(p)
        rows.append({"prompt": p.prompt, "solution": solution, "answer": str(answer)})
    eval_rows, train_rows = rows[:n_eval], rows[n_eval:]
    for i, r in enumerate(train_rows):
        r["id"] = f"train-{i:06d}"
    for i, r in enumerate(eval_rows):
        r["id"] = f"eval-{i:05d}"
    order = lambda r: {k: r[k] for k in COLUMNS}  # noqa: E731 - fixed column order
    return [order(r) for r in train_rows], [order(r) for r in eval_rows]


def parse_prompt(prompt: str) -> Problem:
    """Inverse of ``Problem.prompt`` (for analysis of where a sample went wrong)."""
    body = prompt.removeprefix("Compute ").removesuffix(".")
    tokens, num, op = [], "", None
    for ch in body:
        if ch in "+-":
            tokens.append((op, int(num)))
            num, op = "", ch
        else:
            num += ch
    tokens.append((op, int(num)))
    return Problem(tokens[0][1], tuple((o, x) for o, x in tokens[1:]))
