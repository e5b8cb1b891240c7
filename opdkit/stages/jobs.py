"""Run a stage's jobs side by side, one process per CPU with one thread each, and reuse the ones done.

A ``Job`` is one ``opdkit`` command line (``opdkit.cli.main(argv)``, e.g. ``train --out ...`` or
``eval --model ... --out ...``) with the paths it reads (``inputs``) and writes (``outputs``) and the
part of its resolved config its result depends on (``config``). ``run_jobs`` runs the jobs in
``workers`` worker processes (spawned, so nothing of the driver's state is shared; each keeps its
torch import for the jobs after its first), the most expensive first; each job's output goes to its
own log file. A job's result depends only on its command, config, inputs and code, never on what runs
beside it: every opdkit run is seeded and deterministic with a fixed thread count.

Reuse. The ledger (a JSON file among the stage's outputs) records, for each job that ended with
status 0: its argv, its command (the argv without the params file and ``-S``: their effect is
the config), its config, the fingerprints (``fingerprint``) of its inputs and outputs, and the
sha256 of every opdkit source file its worker process had imported. A later call reuses a job (does
not run it) when all of these are unchanged, so that rerunning a stage after a params change
(``dvc exp run -S loss.name=jsd``) reruns only the jobs the change reaches: what DVC's own per-stage
records did when each job was a stage. Anything else under the stage's output folders (``prune``: a
dropped seed's or arm's outputs, a half-written output) is removed, so they hold exactly the outputs
of the current jobs. A job that fails does not stop the others; its outputs are left as they are,
for its log to explain, and it is not recorded, so the next call runs it again.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from opdkit.persist.fsutil import atomic_write_json

PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # .../opdkit
LEDGER_VERSION = 1


@dataclass(frozen=True)
class Job:
    name: str  # unique within a stage (the ledger's key), e.g. "rkl/seed0"
    argv: tuple[str, ...]  # the opdkit command line (without "opdkit")
    inputs: tuple[str, ...]  # files or directories it reads
    outputs: tuple[str, ...]  # files or directories it writes (nothing else)
    config: dict = field(default_factory=dict, hash=False)  # the resolved params its result depends on
    cost: float = 1.0  # relative cost: the most expensive jobs start first
    log: str = ""  # where its stdout and stderr go

    def command(self) -> list[str]:
        """The argv without its params file and -S overrides, whose effect is ``config``: what the
        reuse check compares besides it (the subcommand, paths, tags)."""
        out, skip = [], False
        for a in self.argv:
            if skip:
                skip = False
            elif a in ("-p", "--params", "-S", "--set"):
                skip = True
            else:
                out.append(a)
        return out


# --- fingerprints ----------------------------------------------------------------------------


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def fingerprint(path: str | Path) -> str | None:
    """sha256 of a file; of a directory, over its files' relative paths and sha256 (sorted); None if
    ``path`` does not exist."""
    p = Path(path)
    if p.is_file():
        return file_sha256(p)
    if not p.is_dir():
        return None
    h = hashlib.sha256()
    for f in sorted(q for q in p.rglob("*") if q.is_file()):
        h.update(f"{f.relative_to(p).as_posix()}\0{file_sha256(f)}\n".encode())
    return "dir-" + h.hexdigest()


def imported_code() -> dict[str, str]:
    """``{"opdkit/<module>.py": sha256}`` of every opdkit module this process has imported."""
    out = {}
    for mod in list(sys.modules.values()):
        f = getattr(mod, "__file__", None)
        if f and Path(f).resolve().is_relative_to(PACKAGE_ROOT) and Path(f).suffix == ".py":
            out[Path(f).resolve().relative_to(PACKAGE_ROOT.parent).as_posix()] = file_sha256(Path(f))
    return dict(sorted(out.items()))


def _plain(x):
    """JSON-shaped (tuples as lists), for comparison with what the ledger read back."""
    return json.loads(json.dumps(x))


def _first_difference(old, new, prefix: str = "") -> str:
    if isinstance(old, dict) and isinstance(new, dict):
        for k in sorted(set(old) | set(new)):
            if old.get(k) != new.get(k):
                return _first_difference(old.get(k), new.get(k), f"{prefix}{k}.")
    return f"{prefix.rstrip('.')}: {old!r} -> {new!r}"


def stale_reason(job: Job, record: dict | None) -> str | None:
    """Why ``job`` must run although the ledger holds ``record`` (None: it may be reused)."""
    if record is None:
        return "not run before"
    if record.get("command") != job.command():
        return "its command changed"
    if record.get("config") != _plain(job.config):
        return f"params changed ({_first_difference(record.get('config'), _plain(job.config))})"
    for key, paths in (("inputs", job.inputs), ("outputs", job.outputs)):
        recorded = record.get(key, {})
        if sorted(recorded) != sorted(paths):
            return f"its {key} changed"
        for p in paths:
            if fingerprint(p) != recorded[p]:
                return f"{'input' if key == 'inputs' else 'output'} {p} changed" + (
                    "" if Path(p).exists() else " (missing)")
    for f, sha in record.get("code", {}).items():
        src = PACKAGE_ROOT.parent / f
        if not src.is_file() or file_sha256(src) != sha:
            return f"code changed ({f})"
    return None


def read_ledger(path: str | Path) -> dict:
    """The ledger's job records (``{}`` if there is none yet or it is of another version)."""
    p = Path(path)
    if not p.is_file():
        return {}
    try:
        raw = json.loads(p.read_text())
    except json.JSONDecodeError:
        return {}
    return raw.get("jobs", {}) if raw.get("version") == LEDGER_VERSION else {}


# --- the output folders ----------------------------------------------------------------------


def prune(roots: list[str | Path], keep: list[str | Path]) -> list[Path]:
    """Remove everything under each of ``roots`` that is neither one of ``keep`` nor a folder on the
    way to one; returns what was removed."""
    keep_abs = {Path(k).absolute() for k in keep}
    removed: list[Path] = []

    def walk(d: Path) -> None:
        for child in sorted(d.iterdir()):
            a = child.absolute()
            if a in keep_abs:
                continue
            if child.is_dir() and not child.is_symlink() and any(k.is_relative_to(a) for k in keep_abs):
                walk(child)
                continue
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
            removed.append(child)

    for r in map(Path, roots):
        if r.is_dir():
            walk(r)
    return removed


def _clear_outputs(job: Job) -> None:
    """A job runs from scratch: whatever its outputs held before (another config's run) goes."""
    for p in map(Path, job.outputs):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()


# --- the worker processes --------------------------------------------------------------------


def init_worker(threads: int) -> None:
    """A worker process's environment (train stage, eval stage, calibration): one thread, no spinning."""
    os.environ["OMP_NUM_THREADS"] = str(threads)  # before torch is imported (the first job imports it)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # an idle worker ignores ^C; a run in flight handles it itself


@contextlib.contextmanager
def _output_to(path: Path):
    """The process's stdout and stderr (file descriptors 1 and 2) into ``path`` inside the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush(), sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "w") as f:
        os.dup2(f.fileno(), 1), os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
            os.close(saved[0]), os.close(saved[1])


def _run_one(argv: tuple[str, ...], log: str) -> tuple[int, float, dict[str, str]]:
    """In a worker: ``opdkit.cli.main(argv)`` -> (exit status, seconds, the opdkit code imported)."""
    from opdkit.cli import main

    t0 = time.monotonic()
    with _output_to(Path(log)):
        try:
            status = main(list(argv))
        except SystemExit as e:  # argparse's usage errors
            status = e.code if isinstance(e.code, int) else 2
        except BaseException:  # noqa: BLE001 - a crash is this job's failure (its log has the traceback)
            traceback.print_exc()
            status = 1
    return int(status), time.monotonic() - t0, imported_code()


def _tail(path: str, n: int = 15) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def run_jobs(jobs: list[Job], ledger: str | Path, workers: int, threads: int, roots: list[str | Path],
             keep: list[str | Path] = (), log=print) -> int:
    """Run the ``jobs`` not reusable from ``ledger`` in ``workers`` processes of ``threads`` threads
    each; then prune ``roots`` to the jobs' outputs (and ``keep``) and write the ledger. Returns 0
    when every job succeeded (or was reused), else 1 (the failed jobs are named with their logs' tails)."""
    names = [j.name for j in jobs]
    outs = [o for j in jobs for o in j.outputs]
    if len(set(names)) != len(names) or len(set(outs)) != len(outs):
        raise ValueError("run_jobs: two jobs share a name or an output")
    records = read_ledger(ledger)
    todo, kept = [], {}
    for j in jobs:
        why = stale_reason(j, records.get(j.name))
        if why is None:
            kept[j.name] = records[j.name]
            log(f"{j.name}: reused (command, params, inputs, code and outputs unchanged)")
        else:
            todo.append(j)
            log(f"{j.name}: runs ({why})")
    for j in todo:
        _clear_outputs(j)
    for p in prune(roots, outs + list(keep) + [ledger]):
        log(f"removed {p} (no job of this stage writes it)")
    failed: list[Job] = []
    if todo:
        n = max(1, min(workers, len(todo)))
        log(f"running {len(todo)} job(s) in {n} process(es) of {threads} thread(s) each; logs: "
            f"{', '.join(sorted({str(Path(j.log).parent) for j in todo}))}")
        ctx = multiprocessing.get_context("spawn")
        pool = cf.ProcessPoolExecutor(max_workers=n, mp_context=ctx, initializer=init_worker, initargs=(threads,))
        t0 = time.monotonic()
        try:
            futures = {pool.submit(_run_one, j.argv, j.log): j for j in sorted(todo, key=lambda j: -j.cost)}
            for fut in cf.as_completed(futures):
                j = futures[fut]
                try:
                    status, seconds, code = fut.result()
                except Exception as e:  # noqa: BLE001 - a worker that died (killed, out of memory)
                    status, seconds, code = 1, float("nan"), {}
                    log(f"{j.name}: its worker process died ({type(e).__name__}: {e})")
                if status == 0:
                    kept[j.name] = {"argv": list(j.argv), "command": j.command(), "config": _plain(j.config),
                                    "inputs": {p: fingerprint(p) for p in j.inputs},
                                    "outputs": {p: fingerprint(p) for p in j.outputs},
                                    "code": code, "seconds": round(seconds, 3)}
                    log(f"{j.name}: done in {seconds:.1f}s ({time.monotonic() - t0:.0f}s into the stage)")
                else:
                    failed.append(j)
                    log(f"{j.name}: FAILED with exit status {status}; the end of {j.log}:\n{_tail(j.log)}")
        except KeyboardInterrupt:
            pool.shutdown(wait=True, cancel_futures=True)  # runs in flight stop after their step (they saw ^C)
            _write_ledger(ledger, kept, jobs)
            raise
        pool.shutdown(wait=True)
    _write_ledger(ledger, kept, jobs)
    if failed:
        log(f"{len(failed)} of {len(jobs)} job(s) failed: {', '.join(j.name for j in failed)} (the others are "
            "recorded and will be reused)")
        return 1
    return 0


def _write_ledger(path: str | Path, records: dict, jobs: list[Job]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    ordered = {j.name: records[j.name] for j in jobs if j.name in records}
    atomic_write_json(path, {"version": LEDGER_VERSION, "jobs": ordered})


def default_workers(threads: int) -> int:
    """Processes that fit the CPUs this process may run on (``os.sched_getaffinity``, so ``taskset``
    limits them) at ``threads`` threads each."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, threads))
