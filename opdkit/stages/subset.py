"""DVC stage ``data``: the pinned, fingerprinted data subset the rest of the pipeline uses.

Reads the ``data`` params section (``data.filters``, ``data.max_rows``; params < the params'
recipe < -S, as every command reads them), selects rows of the train
and eval tables exactly as ``opdkit train`` / ``opdkit eval`` would (``data.load_examples``), and
writes the selected rows as parquet, plus an info JSON with the row counts and the sha256
fingerprint of each subset (the fingerprint a checkpoint trained on it records). Selecting the
subset again is the identity, so the commands downstream see exactly these rows.

    python -m opdkit.stages.subset --train IN.parquet --eval IN.parquet \
        --out-train runs/data/train.parquet --out-eval runs/data/eval.parquet --info runs/data/subset.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from opdkit.config import ConfigError
from opdkit.data import Example, fingerprint, load_examples, write_rows
from opdkit.recipes import load_config


def example_row(ex: Example, teacher_column: str = "") -> dict:
    """The row ``data.normalize_row`` reads back as the same ``Example`` (its teacher, where it names
    one, in ``teacher_column``)."""
    prompt = ex.prompt if isinstance(ex.prompt, str) else [dict(m) for m in ex.prompt]
    row = {"id": ex.id, "prompt": prompt, "answer": ex.answer, "solution": ex.solution, "source": ex.source}
    return row | ({teacher_column: ex.teacher} if ex.teacher and teacher_column else {})


def write_subset(src: Path, dst: Path, data_cfg) -> dict:
    examples = load_examples(src, data_cfg)
    write_rows([example_row(ex, data_cfg.teacher_column) for ex in examples], dst)
    if fingerprint(load_examples(dst, data_cfg)) != fingerprint(examples):
        raise RuntimeError(f"{dst} does not read back as the rows selected from {src} (a bug in example_row)")
    return {"source": str(src), "path": str(dst), "rows": len(examples), "fingerprint": fingerprint(examples)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m opdkit.stages.subset", description=__doc__.split("\n\n")[0])
    ap.add_argument("--train", required=True, help="train table to select from (parquet/jsonl)")
    ap.add_argument("--eval", required=True, help="eval table to select from (parquet/jsonl)")
    ap.add_argument("--out-train", required=True)
    ap.add_argument("--out-eval", required=True)
    ap.add_argument("--info", required=True, help="JSON with row counts and fingerprints")
    ap.add_argument("-p", "--params", default="params.yaml")
    ap.add_argument("-S", "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    try:
        data_cfg = load_config(args.params, None, args.overrides).data  # this stage reads the data section only
    except ConfigError as e:
        print(f"opdkit.stages.subset: error: {e}", file=sys.stderr)
        return 2
    info = {"train": write_subset(Path(args.train), Path(args.out_train), data_cfg),
            "eval": write_subset(Path(args.eval), Path(args.out_eval), data_cfg)}
    Path(args.info).parent.mkdir(parents=True, exist_ok=True)
    Path(args.info).write_text(json.dumps(info, indent=2) + "\n")
    for split, d in info.items():
        print(f"{split}: {d['rows']} rows from {d['source']} -> {d['path']} (fingerprint {d['fingerprint'][:12]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
