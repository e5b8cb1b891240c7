"""Evaluate every kept checkpoint of one training run and write its learning curve (``curve.json``).

The pipeline's ``eval`` stage (``opdkit.stages.eval_runs``) runs the same commands for every run of the
arm x seed matrix side by side, and writes their curves with ``write_curve``.

The final checkpoint (``checkpoint-<--steps>``, which must be the run's last) is evaluated into
``--out`` exactly as ``opdkit eval --model it --out OUT`` writes it (this driver calls that command, in
one process for all checkpoints, so the model-free start-up is paid once); the earlier kept ones
into ``--curve-dir/checkpoint-<step>.json``. ``--curve-dir/curve.json`` then lists, per evaluated
checkpoint, the step, the run's elapsed training seconds and cumulative completion tokens at that step
(from ``metrics/train.jsonl``), and the accuracy with its clustered stderr: the learning curve that
``opdkit.studies.report.learning_curves`` averages over seeds. The tags (``--tag arm=rkl --tag seed=0``) go into
every eval JSON and the curve.

    python -m opdkit.stages.eval_checkpoints --run runs/train/rkl/seed0 --steps 120 \
        --data runs/data/eval.parquet --out runs/eval/rkl/seed0.json --curve-dir runs/curves/rkl/seed0 \
        --tag arm=rkl --tag seed=0
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from opdkit.cli import main as opdkit_main
from opdkit.persist.fsutil import list_checkpoints, step_of
from opdkit.studies.report import read_jsonl


def curve_point(eval_json: Path, step: int, metrics: list[dict]) -> dict:
    """One point of a learning curve: ``step``, ``elapsed_s`` and ``tokens`` (cumulative) at that step of the
    run's metrics rows, with the eval's ``accuracy`` and ``stderr``; step 0 is the start (0 s, 0 tokens)."""
    upto = [r for r in metrics if r["step"] <= step]
    if step and (not upto or upto[-1]["step"] != step):
        raise ValueError(f"metrics/train.jsonl has no row for step {step} (the checkpoint {eval_json.stem}): "
                         "is it the run this checkpoint came from?")
    ev = json.loads(eval_json.read_text())
    return {"step": step, "elapsed_s": upto[-1]["elapsed_s"] if step else 0.0,
            "tokens": int(sum(r["tokens"] for r in upto)), "accuracy": ev["accuracy"], "stderr": ev["stderr"],
            "file": str(eval_json)}


def check_last_step(run: Path, steps: int) -> list[Path]:
    """The run's checkpoints (sorted by step); ``ValueError`` unless the last is ``checkpoint-<steps>``."""
    checkpoints = list_checkpoints(run / "checkpoints")
    if not checkpoints or step_of(checkpoints[-1]) != steps:
        raise ValueError(f"{run}/checkpoints ends at {checkpoints[-1].name if checkpoints else 'no checkpoint'}, "
                         f"expected checkpoint-{steps} (the arm's step budget)")
    return checkpoints


def write_curve(run: Path, curve_dir: Path, tags: dict, evaluated: list[tuple[int, Path]]) -> Path:
    """``curve_dir/curve.json``: the tags, the run and a ``curve_point`` per (step, eval JSON)."""
    metrics = read_jsonl(run / "metrics" / "train.jsonl")
    points = [curve_point(out, step, metrics) for step, out in evaluated]
    curve_dir.mkdir(parents=True, exist_ok=True)
    path = curve_dir / "curve.json"
    path.write_text(json.dumps({**tags, "run": str(run), "points": points}, indent=2) + "\n")
    return path


def eval_argv(checkpoint: Path, out: Path, data: str, tags: list[str], params: str | None,
              overrides: list[str]) -> list[str]:
    """The ``opdkit eval`` command line of one checkpoint (tagged with its step, then ``tags``)."""
    return ["eval", "--model", str(checkpoint), "--out", str(out), "--tag", f"step={step_of(checkpoint)}",
            "--data", data, "--quiet", *sum((["--tag", t] for t in tags), []),
            *(["-p", params] if params else []), *sum((["-S", s] for s in overrides), [])]


def eval_out(checkpoint: Path, steps: int, final: Path, curve_dir: Path) -> Path:
    """Where a checkpoint's eval JSON goes: ``final`` for ``checkpoint-<steps>``, else the curve dir."""
    return final if step_of(checkpoint) == steps else curve_dir / f"{checkpoint.name}.json"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m opdkit.stages.eval_checkpoints", description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", required=True, help="an `opdkit train --out` directory")
    ap.add_argument("--steps", type=int, required=True, help="the run's step budget: its last checkpoint's step")
    ap.add_argument("--data", required=True, help="eval table (parquet/jsonl)")
    ap.add_argument("--out", required=True, help="eval JSON of the final checkpoint (the .jsonl beside it)")
    ap.add_argument("--curve-dir", required=True, help="eval JSONs of the earlier checkpoints and curve.json")
    ap.add_argument("--tag", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("-p", "--params", default=None)
    ap.add_argument("-S", "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    run, curve_dir = Path(args.run), Path(args.curve_dir)
    try:
        checkpoints = check_last_step(run, args.steps)
    except ValueError as e:
        print(f"opdkit.stages.eval_checkpoints: error: {e}", file=sys.stderr)
        return 2
    evaluated = []
    for ck in checkpoints:
        out = eval_out(ck, args.steps, Path(args.out), curve_dir)
        status = opdkit_main(eval_argv(ck, out, args.data, args.tag, args.params, args.overrides))
        if status:
            return status
        evaluated.append((step_of(ck), out))
    write_curve(run, curve_dir, dict(t.partition("=")[::2] for t in args.tag), evaluated)
    names = ", ".join(ck.name for ck in checkpoints)
    print(f"{run}: evaluated {names}; wrote {args.out} and {curve_dir / 'curve.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
