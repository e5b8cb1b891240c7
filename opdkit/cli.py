"""Command line: ``opdkit <command> [-p params.yaml] [-S key=value ...]``.

Exit statuses: 0 success; 1 a failure during the work (the message says which checkpoints
survive: a crash, a full or read-only disk, out of memory, a publish error, a collective of a torchrun
rank that timed out or lost its peer); 2 bad input (one line
naming the file/key and what was expected, nothing written); 3 values went non-finite (nothing
non-finite is saved or published); 75 the output directory is locked by another run (``opdkit eval``:
the GPU is held by a training run or by any other compute process); 128+N
stopped by signal N (SIGINT, SIGTERM: after the step in flight, its state and checkpoint saved).

CPU threads wait passively (``OMP_WAIT_POLICY=PASSIVE``, set before torch is imported, unless the
environment sets it): spinning OpenMP threads that lose their core to another process make every
step several times slower.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import signal
import sys
import traceback
from pathlib import Path

EXIT_FAILURE, EXIT_BAD_INPUT, EXIT_NONFINITE, EXIT_LOCKED = 1, 2, 3, 75


def _add_params(p: argparse.ArgumentParser) -> None:
    p.add_argument("-p", "--params", default=None,
                   help="params YAML (default: params.yaml if present, else built-in defaults; 'none': built-in "
                        "defaults)")
    p.add_argument("-r", "--recipe", default=None, metavar="FILE",
                   help="a params overlay from recipes/ (params < recipe < -S); without -r, the recipe the params "
                        "name in their 'recipe' key is applied (a path relative to the params file); -r '' applies "
                        "none")
    p.add_argument("-S", "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a params key (dotted path), e.g. -S loss.name=jsd; repeatable")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def _params_path(args) -> str | None:
    """-p FILE; else params.yaml if present; None (the built-in defaults) for none or -p none."""
    path = args.params
    if path is None and Path("params.yaml").is_file():
        path = "params.yaml"
    return None if path == "none" else path  # none: opdkit.config's defaults, whatever the directory holds


def _config(args):
    """params < recipe (-r FILE, else the params' own `recipe` key) < -S overrides."""
    from opdkit.recipes import load_config

    return load_config(_params_path(args), args.recipe, args.overrides)


def _refuse_unwritable(out: str, *beside: Path) -> None:
    """``ConfigError`` (exit 2, one line) naming ``--out`` where it, or a file written ``beside`` it, cannot be
    written (``fsutil.unwritable``: read-only, a path through a file), checked before the command does anything
    (a traceback at the first write, after the work, otherwise)."""
    from opdkit.config import ConfigError
    from opdkit.persist.fsutil import unwritable

    for path in (Path(out), *beside):
        if problem := unwritable(path):
            raise ConfigError(f"--out {out}: {path} cannot be written: {problem}; name a place this process may "
                              "write")


def cmd_embedded(args) -> int:
    from opdkit.config import to_dict
    from opdkit.embedded import copy_shipped, write_manifest

    _refuse_unwritable(args.out)
    out = Path(args.out)
    if args.bpe_teacher:  # the cross-tokenizer teacher: built on demand, cached in OUT
        cfg = _config(args)  # (bad params are refused before the builder's imports)
        from opdkit.embedded.bpe_teacher import build_bpe_teacher

        made = build_bpe_teacher(out, cfg.embedded, log=(lambda *a: None) if args.quiet else print)["made"]
        print(f"the embedded BPE teacher is in {out} (built in {made['build_seconds']}s)")
        return 0
    if not args.rebuild:
        copy_shipped(out)
        print(f"wrote the shipped embedded task and models to {out} (data/, teacher/, student/, manifest.json)")
        return 0
    cfg = _config(args)
    from opdkit.embedded.build import build_at, shipped_capability

    made = build_at(out, cfg.embedded, shipped_capability())  # the CPU kernels the shipped build ran
    write_manifest(out, to_dict(cfg.embedded), made)
    print(f"rebuilt the embedded task and models in {out} in {made['build_seconds']}s "
          f"({made['environment']['cpu_capability']} kernels, as the shipped manifest records)")
    return 0


def cmd_fixture(args) -> int:
    from opdkit.fixture import build_qwen2

    _refuse_unwritable(args.out)
    made = build_qwen2(Path(args.out), seed=args.seed)
    print(f"wrote the {args.kind} fixture to {args.out} (student/, teacher/, data/train.parquet, data/eval.parquet, "
          f"manifest.json) in {made['build_seconds']}s")
    return 0


def _on_gpu(cfg) -> bool:
    """The GPU rules apply to this command (``runtime.device_lock``: auto = on CUDA devices, always, never)."""
    rt = cfg.runtime
    if rt.device_lock == "never" or (rt.device_lock == "auto" and rt.device == "cpu"):
        return False
    if rt.device_lock == "auto":
        import torch

        return torch.cuda.is_available()
    return True


def _device_lock(cfg, shared: bool):
    """The GPU workload lock for this command (``_on_gpu``), else a no-op context. Training holds it
    shared, evaluation exclusively; a conflict raises ``DeviceBusy``."""
    from opdkit.persist.fsutil import DeviceLock

    return DeviceLock(shared) if _on_gpu(cfg) else contextlib.nullcontext()


def cmd_eval(args) -> int:
    cfg = _config(args)  # bad params are refused before torch is imported
    from opdkit import paths
    from opdkit.data import load_eval_examples
    from opdkit.evaluate import (
        check_engine,
        check_out,
        evaluate,
        parse_tags,
        protocol_record,
        weights_device,
        write_eval,
    )
    from opdkit.models import check_model_dir, compute_dtype, load_model, pick_device, setup_torch
    from opdkit.pairs import tokenizer_of

    tags = parse_tags(args.tag)  # a bad tag, or an --out that cannot be written, is refused before anything is run
    check_engine(cfg.eval)  # eval.engine=vllm without vLLM: before any model loads
    check_out(args.out)
    _refuse_unwritable(args.out, Path(args.out).with_suffix(".jsonl"))
    setup_torch(cfg.runtime)
    data_paths = [Path(d) for d in args.data] if args.data else [paths.eval_data_path(cfg)]
    examples = load_eval_examples(data_paths)
    tok, _ = tokenizer_of(check_model_dir(args.model), "model")  # a bad directory: one line, before the GPU and weights
    with _device_lock(cfg, shared=False):  # no training may hold the GPU while this evaluates
        if _on_gpu(cfg):  # nor any other compute process (a run still saving, a server): asked before ours exists
            from opdkit.gpu_procs import check_gpu_free

            check_gpu_free()
        device = pick_device(cfg.runtime)
        model = load_model(args.model, weights_device(cfg.eval, device), compute_dtype(cfg.runtime, device))
        summary, records = evaluate(model, tok, examples, cfg.data, cfg.eval, progress=not args.quiet,
                                    log=lambda line: print(line, file=sys.stderr), device=device)
    summary.update(model=str(args.model),
                   data=str(data_paths[0]) if len(data_paths) == 1 else [str(d) for d in data_paths],
                   **protocol_record(cfg.eval, summary["n_questions"]))
    summary.update(tags)
    per_q = write_eval(summary, records, args.out)
    print(f"accuracy {summary['accuracy']:.4f} +- {summary['stderr']:.4f} (clustered stderr) over "
          f"{summary['n_questions']} questions x {cfg.eval.n_samples}; wrote {args.out} and {per_q}")
    if summary.get("protocol_complete") is False:
        print(f"note: eval.protocol={cfg.eval.protocol} is defined on {summary['protocol_questions']} questions; this "
              f"evaluation has {summary['n_questions']}, so it is not that measurement", file=sys.stderr)
    return 0


def _probe_lock(out: Path, what: str = "output directory") -> None:
    """Raise ``LockHeld`` at once if another run holds ``out``'s lock (before anything slow is
    loaded). Creates and changes nothing; ``train`` takes the lock for real after validating."""
    import fcntl

    from opdkit.persist.fsutil import LOCK_NAME, LockHeld

    try:
        fd = os.open(out / LOCK_NAME, os.O_RDONLY)
    except OSError:
        return  # no lock file (or unreadable): nobody holds it, or train() will say why
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 256, 0).decode("utf-8", "replace").strip() or "pid unknown"
        raise LockHeld(out, holder, what) from None
    except OSError:
        return  # a file system without flock on read-only handles: train() decides
    finally:
        os.close(fd)  # also releases our probe


def _quiet_datasets() -> None:
    """``datasets`` draws a progress bar and logs an error line while reading a parquet file; the
    ``DataError`` raised for a bad file already says what is wrong, in one line."""
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("DATASETS_VERBOSITY", "critical")  # read when datasets is imported


def _to_devnull(stream) -> None:
    """Point ``stream``'s file descriptor at /dev/null (its reader is gone): later writes and flushes succeed."""
    fd = os.open(os.devnull, os.O_WRONLY)
    os.dup2(fd, stream.fileno())
    os.close(fd)


class _Guarded:
    """``sys.stdout`` or ``sys.stderr`` while a run trains: a write or flush to a reader that has stopped (``opdkit
    train | head``, ``... 2>&1 | head``) points the descriptor at /dev/null instead of raising, wherever it comes
    from (the run's log lines; transformers' and tqdm's progress bars, from their own code), so the run goes on;
    ``notice()``, if given, is said once on stderr when that happens."""

    def __init__(self, stream, notice=None):
        self._stream, self._notice = stream, notice

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._gone()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._gone()

    def _gone(self) -> None:
        _to_devnull(self._stream)  # what is still buffered goes nowhere
        notice, self._notice = self._notice, None
        if notice is not None:
            print(f"opdkit: {notice()}", file=sys.stderr, flush=True)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def cmd_train(args) -> int:
    def notice() -> str:
        from opdkit.persist.rundir import METRICS_FILE  # imported by the run already

        return ("stdout's reader stopped reading; training goes on, its log lines no longer shown (its steps: "
                f"{Path(args.out) / METRICS_FILE})")

    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Guarded(sys.stdout, notice), _Guarded(sys.stderr)
    try:
        return _train_command(args)
    finally:
        sys.stdout, sys.stderr = streams


def _train_command(args) -> int:
    out = Path(args.out)
    if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 alone takes the lock
        _probe_lock(out)  # before anything slow is imported
    cfg = _config(args)
    if cfg.runtime.state_dir and os.environ.get("RANK", "0") == "0":
        _probe_lock(Path(cfg.runtime.state_dir), "trainer state directory")
    _quiet_datasets()
    from opdkit.deadline import started_at
    from opdkit.guards import NonFiniteError, OutOfMemory
    from opdkit.interrupt import stop_on_signals
    from opdkit.persist.checkpoints import NonFiniteTensor, surviving_checkpoints_message
    from opdkit.persist.fsutil import StorageError
    from opdkit.persist.publish import PublishError
    from opdkit.persist.trainer_state import find as find_state
    from opdkit.train import preflight, train

    if args.check:
        inputs = preflight(cfg, out)
        for w in inputs.warnings:
            print(f"warning: {w.check}: {w.detail}")
        with _device_lock(cfg, shared=True):  # free for training now (an evaluation holds it: exit 75)
            pass
        teacher = ", ".join(map(str, inputs.teacher_paths.values())) or cfg.teacher.source
        print(f"inputs ok: student {inputs.student_path}, teacher {teacher}, data {inputs.train_path} "
              f"({len(inputs.examples)} rows); {out} is free")
        return 0
    from opdkit import distributed

    device_lock = _device_lock(cfg, shared=True)  # held for the whole run; released when training has ended
    device_lock.__enter__()  # before the models load: an evaluation on the GPU refuses this run at once (exit 75)
    world = distributed.init(cfg.runtime)  # a no-op without torchrun

    def survivors() -> str:
        return surviving_checkpoints_message(out / "checkpoints")

    try:
        with stop_on_signals():  # SIGTERM/SIGINT: a flag the loop reads between steps
            result = train(cfg, out, log=functools.partial(print, flush=True),  # each line as it comes
                           progress=not args.quiet, started_at=started_at())
    except _expected_errors():
        raise  # main() prints these as one line
    except PublishError as e:
        if isinstance(e.__cause__, NonFiniteTensor):
            print(f"opdkit: stopped, nothing non-finite was published: {e}", file=sys.stderr)
            return EXIT_NONFINITE
        raise
    except NonFiniteError as e:
        state = find_state(out, cfg.runtime.state_dir)
        kept = (f"the trainer state {state} is the last good one (a rerun resumes from it)" if state else
                "no trainer state was saved before (a rerun starts from the beginning)")
        print(f"opdkit: training stopped: {e}; {kept}; {survivors()}", file=sys.stderr)
        return EXIT_NONFINITE
    except (OutOfMemory, StorageError, distributed.CollectiveFailure) as e:
        print(f"opdkit: training failed: {e}; {survivors()}", file=sys.stderr)
        return EXIT_FAILURE
    except Exception as e:  # a crash: the traceback, then what survives (never exit 0)
        traceback.print_exc()
        print(f"opdkit: training failed ({type(e).__name__}: {e}); {survivors()}", file=sys.stderr)
        return EXIT_FAILURE
    finally:
        distributed.shutdown()
        device_lock.__exit__(None, None, None)
    if result.status == "stopped":
        sig = signal.Signals[result.reason]
        if world.is_main:
            print(f"opdkit: training stopped by {sig.name} at step {result.step}; {survivors()}", file=sys.stderr)
        return 128 + sig
    if world.is_main:
        print(json.dumps(result.__dict__), flush=True)
    return 0


def cmd_offline_rollouts(args) -> int:
    cfg = _config(args)
    _refuse_unwritable(args.out)
    _quiet_datasets()
    from opdkit.offline_draw import draw_pool

    draw_pool(cfg, args.policy, args.out, args.prompts, args.topk, progress=not args.quiet)
    return 0


def cmd_vocab_cut(args) -> int:
    from opdkit.engines.vllm_teacher import vocab_cut

    _refuse_unwritable(args.out)
    try:
        made = vocab_cut(args.model, args.out)
    except (FileExistsError, ValueError) as e:
        print(f"opdkit: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"wrote {made['dst']}: {made['src']} with its embedding and head cut from {made['rows']:,} rows to the "
          f"tokenizer's {made['ids']:,} ids ({', '.join(made['cut'])}); serve it with vllm serve {made['dst']}")
    return 0


def cmd_validate(args) -> int:
    from opdkit.persist.checkpoints import is_valid_checkpoint

    all_ok = True
    for d in args.dir:
        ok, reason = is_valid_checkpoint(d)
        print(f"{d}: {'valid' if ok else 'INVALID: ' + reason}")
        all_ok &= ok
    return 0 if all_ok else EXIT_FAILURE


def cmd_doctor(args) -> int:
    """The pair's pre-flight checks as one table; exit 1 on any FAIL (2: bad arguments). Writes nothing."""
    cfg = _config(args)
    _quiet_datasets()
    from transformers.utils import logging as hf_logging

    from opdkit.doctor import diagnose, format_table, with_pair

    hf_logging.disable_progress_bar()  # "Loading weights" bars between the doctor's own lines
    cfg = with_pair(cfg, args.student, args.teacher, args.data)
    log = (lambda _: None) if args.quiet else (lambda msg: print(f"doctor: {msg}", file=sys.stderr, flush=True))
    findings = diagnose(cfg, log)
    print(format_table(findings))
    return EXIT_FAILURE if any(f.status == "FAIL" for f in findings) else 0


def cmd_study(args) -> int:
    from opdkit import studies

    cfg = _config(args)
    _refuse_unwritable(args.out)
    fn = {"padding": studies.padding_study, "clipped-mass": studies.clipped_mass_study}[args.which]
    result = fn(cfg, Path(args.out), progress=not args.quiet)
    print(json.dumps({k: v for k, v in result.items() if not isinstance(v, (list, dict))}))
    return 0


def cmd_report(args) -> int:
    from opdkit.config import load_config
    from opdkit.studies.report import PATTERN_FIELDS, expand_runs, report

    if args.out:
        _refuse_unwritable(args.out)
    evals = [Path(p) for p in args.evals]
    if any(f in p for p in args.evals for f in PATTERN_FIELDS):
        # the matrix as dvc.yaml reads it: the params file as it is (no recipe), plus -S
        evals = expand_runs(args.evals, load_config(_params_path(args), args.overrides))
    try:
        result = report(evals, baseline=args.baseline, group_key=args.group_key)
    except (ValueError, FileNotFoundError) as e:  # a missing or untagged eval JSON, an unknown baseline
        print(f"opdkit: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    if args.table:
        from opdkit.studies.report import format_report

        text = format_report(result)
    print(text)
    return 0


REPEATS_TABLE_N = (2, 3, 4, 5, 6, 8, 10, 15, 20, 30, 50)  # the seeds per arm ``opdkit repeats`` tabulates


def cmd_repeats(args) -> int:
    """Seeds per arm to plan: for a seed spread ``--sd``, the repeats that find ``--effect`` and the difference each
    count in REPEATS_TABLE_N (and ``--n``) finds, at ``--power`` and a two-sided ``--alpha`` (``opdkit.stats``)."""
    from opdkit.stats import detectable_effect, repeats_needed

    kw = dict(power=args.power, alpha=args.alpha, paired=args.paired)
    bad = [f"{name} {value} (expected {want})" for name, value, want, ok in (
        ("--sd", args.sd, "> 0: one run's spread over seeds, or one per-seed difference's with --paired", args.sd > 0),
        ("--power", args.power, "between 0 and 1", 0 < args.power < 1),
        ("--alpha", args.alpha, "between 0 and 1", 0 < args.alpha < 1),
        ("--n", args.n, ">= 2 seeds per arm", args.n is None or args.n >= 2)) if not ok]
    if bad:
        print(f"opdkit: error: repeats: {'; '.join(bad)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    counts = sorted({*REPEATS_TABLE_N, *([args.n] if args.n else [])})
    out = {"sd": args.sd, "power": args.power, "alpha": args.alpha, "paired": args.paired,
           "detectable": {str(n): detectable_effect(args.sd, n, **kw) for n in counts}}
    if args.effect is not None:
        out["effect"] = args.effect
        out["repeats_per_arm"] = repeats_needed(args.effect, args.sd, **kw)
    print(json.dumps(out, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="opdkit", description="On-policy distillation research kit")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("embedded", help="write the embedded task and models (or rebuild them)")
    p.add_argument("--out", required=True)
    p.add_argument("--rebuild", action="store_true", help="train them from scratch (deterministic, minutes)")
    p.add_argument("--bpe-teacher", action="store_true",
                   help="write OUT as the embedded teacher with a byte-level BPE tokenizer of its own (cross-tokenizer "
                        "OPD: -S teacher.tokenizer=own -S teacher.path=OUT); trained once, then reused")
    _add_params(p)
    p.set_defaults(fn=cmd_embedded)

    p = sub.add_parser("fixture", help="write the real-scale test fixture: a tiny qwen2 pair with the real Qwen2.5 "
                       "tokenizer, chat template and generation configs, and DAPO / MATH-500-shaped data")
    p.add_argument("kind", choices=["qwen2"])
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0, help="the models' random weights (default 0)")
    p.set_defaults(fn=cmd_fixture)

    p = sub.add_parser("eval", help="sample and grade a model; writes the eval JSON + per-sample jsonl")
    p.add_argument("--model", required=True)
    p.add_argument("--data", action="append", default=None, metavar="FILE",
                   help="parquet/jsonl (default: data.eval); repeat for a benchmark in several files (AIME 2024 and "
                        "2025): their questions are told apart and reported per file (the eval JSON's parts)")
    p.add_argument("--out", required=True)
    p.add_argument("--tag", action="append", default=[], metavar="KEY=VALUE",
                   help="extra fields for the JSON (e.g. arm=k1)")
    _add_params(p)
    p.set_defaults(fn=cmd_eval)

    from opdkit import biases  # torch-free
    from opdkit.loss_table import help_text, xtok_help_text  # torch-free

    p = sub.add_parser("train", help="one OPD run (or the rest of one: resumes from DIR's trainer state)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="losses (-S loss.name=NAME):\n" + help_text() + "\n\nwhere they are not exact:\n"
                              + biases.help_text() + "\n\n" + xtok_help_text())
    p.add_argument("--out", required=True)
    p.add_argument("--check", action="store_true",
                   help="only validate the inputs and OUT (exit 0, 2 or 75); writes nothing")
    _add_params(p)
    p.set_defaults(fn=cmd_train)

    p = sub.add_parser("offline-rollouts", help="draw an offline pool once: a fixed policy's rollouts of the run's "
                       "prompts, scored by the teacher (train on it with -S rollout.source=offline -S "
                       "rollout.offline_file=FILE)")
    p.add_argument("--policy", default=None, metavar="DIR", help="the model that samples (default: student.path, the "
                   "run's student at step 0)")
    p.add_argument("--out", required=True, metavar="FILE.parquet")
    p.add_argument("--prompts", type=int, default=0, metavar="N", help="prompts in the pool (default: "
                   "rollout.prompts_per_step x budget.max_steps, one pass of a run)")
    p.add_argument("--topk", type=int, default=None, metavar="K", help="store the teacher's top-K too (default: "
                   "loss.topk where loss.name reads the teacher's top-K, else 0)")
    _add_params(p)
    p.set_defaults(fn=cmd_offline_rollouts)

    p = sub.add_parser("vocab-cut", help="copy an HF checkpoint with its embedding and head cut to the tokenizer's ids "
                       "(a teacher for teacher.source=vllm, whose prompt log-probs count every row)")
    p.add_argument("--model", required=True, metavar="DIR")
    p.add_argument("--out", required=True, metavar="DIR", help="a new directory")
    p.set_defaults(fn=cmd_vocab_cut)

    p = sub.add_parser("validate", help="exit 0 if DIR is a complete loadable checkpoint (each DIR, if several)")
    p.add_argument("dir", nargs="+")
    p.set_defaults(fn=cmd_validate)

    p = sub.add_parser("doctor", help="pre-flight checks that a student/teacher pair will work: one table of OK / "
                       "WARN / FAIL lines with the fixes (exit 1 on any FAIL); writes nothing")
    p.add_argument("--student", default=None, metavar="DIR", help="student model directory (default: student.path)")
    p.add_argument("--teacher", default=None, metavar="DIR", help="teacher model directory (default: teacher.path)")
    p.add_argument("--data", default=None, metavar="FILE", help="training data, parquet/jsonl (default: data.train)")
    _add_params(p)
    p.set_defaults(fn=cmd_doctor)

    p = sub.add_parser("study", help="mechanism studies")
    p.add_argument("which", choices=["padding", "clipped-mass"])
    p.add_argument("--out", required=True)
    _add_params(p)
    p.set_defaults(fn=cmd_study)

    p = sub.add_parser("report", help="repeat-run statistics over eval JSONs")
    p.add_argument("evals", nargs="+", help="eval JSONs, directories of them (all their *.json), or patterns with "
                   "{arm} and {seed} filled in for each arm and seed of the pipeline (e.g. "
                   "'runs/eval/{arm}/seed{seed}.json': arms loss.name and pipeline.baseline_arm, seeds pipeline.seeds)")
    p.add_argument("--baseline", default=None, help="arm to compare the others against")
    p.add_argument("--group-key", default="arm")
    p.add_argument("--out", default=None, help="write the report's JSON here")
    p.add_argument("--table", action="store_true", help="print the table (what each arm changed, what its seeds can "
                   "find, the warnings), not the JSON")
    p.add_argument("-p", "--params", default=None,
                   help="params YAML whose arms and seeds fill in the patterns, read as dvc.yaml reads it (no recipe; "
                        "default: params.yaml if present, else built-in defaults; 'none': built-in defaults)")
    p.add_argument("-S", "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a params key, e.g. -S pipeline.seeds=[0,1]; repeatable")
    p.set_defaults(fn=cmd_report)

    p = sub.add_parser("repeats", help="seeds per arm to plan: what a number of repeats can find (t-test power)")
    p.add_argument("--sd", type=float, required=True,
                   help="one run's spread over seeds (e.g. 0.015: 1.5 points of accuracy), in the effect's units")
    p.add_argument("--effect", type=float, default=None, help="the difference to find: prints the seeds per arm")
    p.add_argument("--n", type=int, default=None, help="a seed count to add to the table of detectable differences")
    p.add_argument("--paired", action="store_true",
                   help="arms paired by seed: --sd is then the spread of one per-seed difference")
    p.add_argument("--power", type=float, default=0.8)
    p.add_argument("--alpha", type=float, default=0.05, help="the two-sided level")
    p.set_defaults(fn=cmd_repeats)
    return ap


# Bad input (exit 2) and a held lock (exit 75): reported as one line, no traceback. Matched by module and name: an
# exception of a module that was never imported cannot have been raised, so matching imports nothing (a bad key in
# -S fails before torch is imported: in a fraction of a second).
_EXPECTED = (("opdkit.persist.fsutil", "LockHeld"), ("opdkit.config", "ConfigError"), ("opdkit.data", "DataError"),
             ("opdkit.models", "ModelError"), ("opdkit.setup", "RunError"), ("opdkit.embedded", "MissingAsset"),
             ("opdkit.fixture.qwen_tokenizer", "TokenizerSourceError"))


def _loaded(names) -> tuple[type[BaseException], ...]:
    """The exception classes of ``names`` ((module, class) pairs) whose modules are imported."""
    return tuple(getattr(sys.modules[m], n) for m, n in names if m in sys.modules)


def _expected_errors() -> tuple[type[BaseException], ...]:
    return _loaded(_EXPECTED)


def _publish_error() -> tuple[type[BaseException], ...]:
    return _loaded([("opdkit.persist.publish", "PublishError")])


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read when torch (libgomp) loads: before any import of it
    from opdkit.persist.fsutil import LockHeld

    args = build_parser().parse_args(argv)
    if getattr(args, "quiet", False):  # transformers' and huggingface_hub's bars (loading and writing weights) too:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read when they are imported, later than this
    try:
        status = args.fn(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
        return status
    except BrokenPipeError:  # stdout's reader stopped early (`opdkit report ... | head`): it read what it wanted
        _to_devnull(sys.stdout)  # else the flush at exit raises again
        return 128 + signal.SIGPIPE  # as a command of a shell pipeline ended by SIGPIPE
    except LockHeld as e:
        print(f"opdkit: {e}", file=sys.stderr)
        return EXIT_LOCKED
    except _expected_errors() as e:
        print(f"opdkit: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except _publish_error() as e:
        print(f"opdkit: publishing failed, the run stopped: {e}", file=sys.stderr)
        return EXIT_FAILURE
