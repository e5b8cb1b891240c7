"""Experiment tracking of a training run, one call per step: DVCLive (DVC's logger) or TensorBoard.

The params key ``tracking``: ``auto`` (dvclive where the package is installed, else none) | ``dvclive`` |
``tensorboard`` | ``none``. The loop writes ``metrics/train.jsonl`` whatever it says; a tracker logs each
of its rows' finite numbers (everything but ``step``, under the same names) beside it, on rank 0, into the
run's own directory::

    dvclive/metrics.json                the latest step's values (DVCLive's summary; what dvc metrics reads)
    dvclive/params.yaml                 the resolved config
    dvclive/plots/metrics/<name>.tsv    step and value, a row per step
                                        (dvc plots show DIR/dvclive/plots/metrics -x step)
    tensorboard/events.out.tfevents.*   a scalar per name and step (tensorboard --logdir runs/train)

DVCLive runs as it does inside a pipeline stage: ``save_dvc_exp=False`` and ``dvcyaml=None`` (the project's
dvc.yaml says what to plot; ``opdkit.stages.track_runs`` gathers the runs of the pipeline), and without its
DVC-repository set-up (``Live._init_dvc``): outside a DVC project that set-up runs ``dvc init`` on the
enclosing git repository, and in a git repository without commits it raises; it only serves saving
experiments and DVC Studio's repository settings (Studio's environment variables still apply).

Resume. Each start rebuilds the tracker's history from ``metrics/train.jsonl``, which the loop has just
trimmed to the saved step: DVCLive's files are written afresh from those rows (DVCLive's own
``resume=True`` reads the summary's step and appends to the .tsv files, so a killed attempt's rows past the
saved step would stay in its plots), and TensorBoard's ``purge_step=1`` hides every earlier event before
the rows are written again. A start that tracked nothing, or whose tracker failed, leaves no gap.

Failures. A tracker that cannot write (a full disk, a lost mount, a logger's own bug) must not end a long
run whose train.jsonl and checkpoints are fine: the error is logged as a warning, tracking is off for the
rest of that start, and ``run.json``'s ``tracking`` records it (``opdkit.stages.track_runs`` refuses such a
run, so no plot is silently short). A tracker asked for by name whose package is missing is an error
before the run starts (``resolve``).
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

DVCLIVE_DIR = "dvclive"  # in the run's directory
DVCLIVE_METRICS = "plots/metrics"  # DVCLive's per-metric history files, in DVCLIVE_DIR
DVCLIVE_SUMMARY = "metrics.json"  # DVCLive's summary, in DVCLIVE_DIR
TENSORBOARD_DIR = "tensorboard"
PACKAGES = {"dvclive": "dvclive", "tensorboard": "tensorboard"}  # what each tracker imports


class TrackingError(ValueError):
    """A tracker that cannot run here (its package is not installed)."""


def resolve(choice: str) -> str:
    """The tracker ``choice`` stands for here: ``auto`` is dvclive where it is installed, else none;
    raises ``TrackingError`` for a named tracker whose package is missing."""
    if choice == "auto":
        return "dvclive" if importlib.util.find_spec("dvclive") else "none"
    if choice != "none" and importlib.util.find_spec(PACKAGES[choice]) is None:
        raise TrackingError(f"params key 'tracking': {choice} needs the {PACKAGES[choice]} package "
                            "(pip install -e '.[track]'); or set tracking: none")
    return choice


def scalars(row: dict) -> dict[str, int | float]:
    """The finite numbers of a train.jsonl row, without its ``step``: what a tracker logs."""
    return {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))
            and not isinstance(v, bool) and math.isfinite(v)}


def read_history(path: Path) -> list[dict]:
    """The rows of a train.jsonl that the loop has trimmed (every line a row with an int ``step``)."""
    return [json.loads(ln) for ln in path.read_text().splitlines()] if path.is_file() else []


class _DVCLive:
    def __init__(self, out: Path, history: list[dict], params: dict):
        from dvclive import Live

        class _Live(Live):
            def _init_dvc(self):  # no DVC-repository set-up (module docstring)
                pass

        # resume=False: DVCLive clears its history files, which are then written from train.jsonl's rows
        self.live = _Live(dir=str(out / DVCLIVE_DIR), resume=False, save_dvc_exp=False, dvcyaml=None)
        self.live.log_params(params)
        for row in history:
            self._log_metrics(row["step"], scalars(row))
        if history:
            self.live.make_summary()

    def _log_metrics(self, step: int, values: dict) -> None:
        self.live.step = step
        for name, value in values.items():
            self.live.log_metric(name, value)

    def log(self, step: int, values: dict) -> None:
        # make_summary, not next_step: next_step's sync re-reads every history file each step (for Studio)
        self._log_metrics(step, values)
        self.live.make_summary()

    def close(self) -> None:
        self.live.end()


class _TensorBoard:
    def __init__(self, out: Path, history: list[dict], params: dict):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step=1: TensorBoard hides the earlier starts' events (all steps >= 1); the kept rows follow
        self.writer = SummaryWriter(log_dir=str(out / TENSORBOARD_DIR), purge_step=1 if history else None)
        self.writer.add_text("config", "```\n" + json.dumps(params, indent=1) + "\n```", global_step=0)
        for row in history:
            self._add(row["step"], scalars(row))
        self.writer.flush()

    def _add(self, step: int, values: dict) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, global_step=step)

    def log(self, step: int, values: dict) -> None:
        self._add(step, values)
        self.writer.flush()  # a run watched live, and nothing lost if it is killed

    def close(self) -> None:
        self.writer.close()


_BACKENDS = {"dvclive": _DVCLive, "tensorboard": _TensorBoard}


class Tracker:
    """The run's tracker (``kind`` as ``resolve`` returns it; ``none`` does nothing), a context manager.

    ``history``: the run's train.jsonl (trimmed to the start's step), whose rows it logs again first;
    ``params``: the resolved config. ``log(row)`` once per step; ``record`` is what run.json keeps."""

    def __init__(self, kind: str, out: str | Path | None = None, history: str | Path | None = None,
                 params: dict | None = None, log=print):
        self.kind, self.error, self._say, self._backend = kind, None, log, None
        if kind == "none":
            return
        if kind not in _BACKENDS:
            raise ValueError(f"tracker {kind!r}: expected one of {', '.join(_BACKENDS)} or none (see resolve)")
        rows = read_history(Path(history)) if history is not None else []
        try:
            self._backend = _BACKENDS[kind](Path(out), rows, params or {})
        except Exception as e:  # noqa: BLE001 -- see the module docstring: logged, recorded, refused downstream
            self._fail(e, rows[-1]["step"] if rows else 0)
            return
        where = Path(out) / (DVCLIVE_DIR if kind == "dvclive" else TENSORBOARD_DIR)
        log(f"tracking: {kind} into {where}" + (f" ({len(rows)} steps of metrics/train.jsonl logged again)"
                                                 if rows else ""))

    @property
    def record(self) -> dict:
        """``{"kind": ..., "error": None | "step N: ..."}``: what this start's tracker did."""
        return {"kind": self.kind, "error": self.error}

    def log(self, row: dict) -> None:
        """Log one train.jsonl row (its ``step`` and finite numbers); a failure turns tracking off."""
        if self._backend is None:
            return
        try:
            self._backend.log(row["step"], scalars(row))
        except Exception as e:  # noqa: BLE001 -- see the module docstring
            self._fail(e, row["step"])

    def close(self) -> None:
        backend, self._backend = self._backend, None
        if backend is not None:
            try:
                backend.close()
            except Exception as e:  # noqa: BLE001 -- see the module docstring
                self._fail(e, None)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _fail(self, e: Exception, step: int | None) -> None:
        at = f"step {step}" if step is not None else "the end"
        self.error = f"{at}: {type(e).__name__}: {e}"
        self._say(f"warning: tracking ({self.kind}) failed at {at} ({type(e).__name__}: {e}); it is off for the "
                  "rest of this run (metrics/train.jsonl is complete; run.json records the failure)")
        backend, self._backend = self._backend, None
        if backend is not None:
            try:
                backend.close()
            except Exception:  # noqa: BLE001 -- already failed; the first error is the one recorded
                pass
