"""Tables of the docs generated from the code, so they cannot drift from it.

``loss_table_markdown()``: the README's loss table, one row per ``opdkit.loss_table.LOSSES`` entry. In a
markdown file the table sits between ``BEGIN`` and ``END`` (HTML comments, invisible when rendered);
``tests/test_docs.py`` checks that the README's copy is the generated one.

    python -m opdkit.docs_tables                     # print the table
    python -m opdkit.docs_tables --update README.md  # rewrite the table between the markers in place
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from opdkit.loss_table import LOSSES

BEGIN = "<!-- loss table: python -m opdkit.docs_tables --update README.md writes it from opdkit/loss_table.py -->"
END = "<!-- end of the loss table -->"

REWARD = {"advantage": "added to its per-token advantage", "term": "a policy-gradient term beside it",
          "none": "refused"}


def loss_table_markdown() -> str:
    """One row per loss: its name, what it computes, the divergence whose gradient its expected gradient is,
    what the teacher scores for it, and where ``loss.reward_weight``'s reward goes."""
    lines = ["| `loss.name` | what it computes | expected gradient of | the teacher scores | a reward |",
             "|---|---|---|---|---|"]
    for s in LOSSES.values():
        cells = (f"`{s.name}`", s.summary, s.divergence, s.teacher, REWARD[s.reward])
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")  # a | in a cell: \|
    return "\n".join(lines) + "\n"


def between_markers(text: str, where: str) -> tuple[int, int]:
    """The span of ``text`` between the ``BEGIN`` and ``END`` lines (exclusive); ``ValueError`` naming
    ``where`` when they are missing or out of order."""
    start, end = text.find(BEGIN + "\n"), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{where}: expected the line {BEGIN!r}, then the table, then the line {END!r}")
    return start + len(BEGIN) + 1, end


def update(path: Path) -> bool:
    """Rewrite the table between the markers of ``path``; whether anything changed."""
    text = path.read_text()
    a, b = between_markers(text, str(path))
    new = text[:a] + loss_table_markdown() + text[b:]
    if new != text:
        path.write_text(new)
    return new != text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m opdkit.docs_tables", description=__doc__.split("\n\n")[0])
    ap.add_argument("--update", metavar="PAGE", help="rewrite the loss table between the markers of PAGE (markdown)")
    args = ap.parse_args(argv)
    if not args.update:
        sys.stdout.write(loss_table_markdown())
        return 0
    try:
        changed = update(Path(args.update))
    except (OSError, ValueError) as e:
        print(f"opdkit.docs_tables: error: {e}", file=sys.stderr)
        return 2
    print(f"{args.update}: the loss table {'rewritten' if changed else 'was up to date'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
