"""Command line: ``opdkit <command> [-p params.yaml] [-S key=value ...]``.

Exit statuses: 0 success; 1 a failure during the work (the message says which checkpoints
survive); 2 bad input (one line naming the file/key and what was expected); 75 the output
directory is locked by another run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

EXIT_FAILURE, EXIT_BAD_INPUT, EXIT_LOCKED = 1, 2, 75


def _add_params(p: argparse.ArgumentParser) -> None:
    p.add_argument("-p", "--params", default=None, help="params YAML (default: params.yaml if present, else built-in defaults)")
    p.add_argument("-S", "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a params key (dotted path), e.g. -S loss.name=jsd; repeatable")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def _config(args):
    from opdkit.config import load_config

    path = args.params
    if path is None and Path("params.yaml").is_file():
        path = "params.yaml"
    return load_config(path, args.overrides)


def cmd_embedded(args) -> int:
    from opdkit.config import to_dict
    from opdkit.embedded import copy_shipped, write_manifest

    out = Path(args.out)
    if not args.rebuild:
        copy_shipped(out)
        print(f"wrote the shipped embedded task and models to {out} (data/, teacher/, student/, manifest.json)")
        return 0
    from opdkit.embedded.build import build

    cfg = _config(args)
    made = build(out, cfg.embedded)
    write_manifest(out, to_dict(cfg.embedded), made)
    print(f"rebuilt the embedded task and models in {out} in {made['build_seconds']}s")
    return 0


def cmd_eval(args) -> int:
    import torch

    from opdkit import paths
    from opdkit.data import load_examples
    from opdkit.evaluate import evaluate, write_eval
    from opdkit.models import load_model, load_tokenizer, pick_device, setup_torch

    cfg = _config(args)
    setup_torch(cfg.runtime)
    data_path = Path(args.data) if args.data else paths.eval_data_path(cfg)
    examples = load_examples(data_path, cfg.data)
    device = pick_device(cfg.runtime)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = load_model(args.model, device, dtype)
    tok = load_tokenizer(args.model)
    summary, records = evaluate(model, tok, examples, cfg.data, cfg.eval, progress=not args.quiet)
    summary.update(model=str(args.model), data=str(data_path), eval_params={
        k: getattr(cfg.eval, k) for k in ("n_samples", "temperature", "top_p", "max_new_tokens", "seed")})
    for tag in args.tag:
        k, _, v = tag.partition("=")
        summary[k] = v
    per_q = write_eval(summary, records, args.out)
    print(f"accuracy {summary['accuracy']:.4f} +- {summary['stderr']:.4f} (clustered stderr) over "
          f"{summary['n_questions']} questions x {cfg.eval.n_samples}; wrote {args.out} and {per_q}")
    return 0


def cmd_train(args) -> int:
    from opdkit.train import train

    from opdkit.publish import surviving_checkpoints_message

    cfg = _config(args)
    try:
        result = train(cfg, args.out, progress=not args.quiet)
    except (KeyboardInterrupt, Exception):  # report what survives, then fail loudly (never exit 0)
        print(f"opdkit: training failed; {surviving_checkpoints_message(Path(args.out) / 'checkpoints')}", file=sys.stderr)
        raise
    print(json.dumps(result.__dict__))
    return 0


def cmd_validate(args) -> int:
    from opdkit.publish import is_valid_checkpoint

    ok, reason = is_valid_checkpoint(args.dir)
    print(f"{args.dir}: {'valid' if ok else 'INVALID'}{'' if ok else ': ' + reason}")
    return 0 if ok else EXIT_FAILURE


def cmd_study(args) -> int:
    from opdkit import studies

    cfg = _config(args)
    fn = {"padding": studies.padding_study, "clipped-mass": studies.clipped_mass_study}[args.which]
    result = fn(cfg, Path(args.out), progress=not args.quiet)
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, (list, dict))}))
    return 0


def cmd_report(args) -> int:
    from opdkit.report import report

    result = report([Path(p) for p in args.evals], baseline=args.baseline, group_key=args.group_key)
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="opdkit", description="On-policy distillation research kit")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("embedded", help="write the embedded task and models (or rebuild them)")
    p.add_argument("--out", required=True)
    p.add_argument("--rebuild", action="store_true", help="train them from scratch (deterministic, minutes)")
    _add_params(p)
    p.set_defaults(fn=cmd_embedded)

    p = sub.add_parser("eval", help="sample and grade a model; writes the eval JSON + per-sample jsonl")
    p.add_argument("--model", required=True)
    p.add_argument("--data", default=None, help="parquet/jsonl (default: data.eval)")
    p.add_argument("--out", required=True)
    p.add_argument("--tag", action="append", default=[], metavar="KEY=VALUE", help="extra fields for the JSON (e.g. arm=k1)")
    _add_params(p)
    p.set_defaults(fn=cmd_eval)

    p = sub.add_parser("train", help="one OPD run")
    p.add_argument("--out", required=True)
    _add_params(p)
    p.set_defaults(fn=cmd_train)

    p = sub.add_parser("validate", help="exit 0 if DIR is a complete loadable checkpoint")
    p.add_argument("dir")
    p.set_defaults(fn=cmd_validate)

    p = sub.add_parser("study", help="mechanism studies")
    p.add_argument("which", choices=["padding", "clipped-mass"])
    p.add_argument("--out", required=True)
    _add_params(p)
    p.set_defaults(fn=cmd_study)

    p = sub.add_parser("report", help="repeat-run statistics over eval JSONs")
    p.add_argument("evals", nargs="+")
    p.add_argument("--baseline", default=None, help="arm to compare the others against")
    p.add_argument("--group-key", default="arm")
    p.add_argument("--out", default=None)
    p.set_defaults(fn=cmd_report)
    return ap


def main(argv: list[str] | None = None) -> int:
    from opdkit.config import ConfigError
    from opdkit.data import DataError
    from opdkit.embedded import MissingAsset
    from opdkit.fsutil import LockHeld
    from opdkit.models import ModelError
    from opdkit.publish import PublishError
    from opdkit.setup import RunError

    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except LockHeld as e:
        print(f"opdkit: {e}", file=sys.stderr)
        return EXIT_LOCKED
    except (ConfigError, DataError, ModelError, RunError, MissingAsset) as e:
        print(f"opdkit: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except PublishError as e:
        print(f"opdkit: publishing failed, the run stopped: {e}", file=sys.stderr)
        return EXIT_FAILURE
