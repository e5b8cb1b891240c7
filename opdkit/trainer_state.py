"""The trainer state: what resuming a run needs, written tensor by tensor and atomically.

Layout, under a run's output directory (or ``runtime.state_dir``, run.sh's CKPT_DIR, when set)::

    state/trainer_state-<step>/     one complete state; a run resumes from the newest step's
        meta.pt                     step, elapsed wall time, data position, lr clock, RNG, the params
                                    and data fingerprint (small; ``peek`` reads only this)
        .metadata, __<r>_0.distcp   torch.distributed.checkpoint (DCP): ``model`` (the trainable
                                    weights: all of them, or the LoRA adapter alone), ``optimizer``
                                    (its state by parameter name), ``ema`` (an EMA teacher's weights)

Streaming: DCP writes each tensor from where it lives, one at a time, so a save holds no second
copy of the state in host memory (a GPU tensor passes through host memory alone). Under torchrun
every rank writes its own shards, in parallel; nothing is gathered. Tensors are stored by name
with their global shapes, so a state resumes under any number of ranks (DCP reassembles them:
``restore`` reads full tensors into the unsharded run before it is sharded), one process included.

Atomic: a state is written into ``state/.tmp-trainer_state-*``, every file fsynced (``meta.pt``
last), then renamed into place; older states and leftovers of interrupted saves are removed only
after that. A state directory is complete or absent. Transient I/O errors are retried
(``publish.retries``, ``fsutil.retry_io``) by every rank together; a full disk, a quota or a
read-only file system is not, and the error names the directory and the bytes needed.

The single file of older opdkit versions (``state/trainer_state.pt``) is still read (``peek``,
``restore``); the first save replaces it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import time
import warnings
from pathlib import Path

import torch

from opdkit import distributed
from opdkit.config import to_dict
from opdkit.fsutil import explain_storage_errors, fsync_dir, fsync_tree, retry_io
from opdkit.setup import Run, RunError, load_trainable_state

STATE_DIR = "state"
LEGACY_FILE = "trainer_state.pt"  # the single-file state of older versions
META = "meta.pt"
FORMAT = 2  # 1: the legacy single file
_NAME = re.compile(r"^trainer_state-(\d+)(?:\.(\d+))?$")

# --- finding and reading ----------------------------------------------------------------------


def _states(state_dir: Path) -> list[tuple[tuple[int, int], Path]]:
    """The complete states in ``state_dir``, oldest first, by (step, save number)."""
    found = []
    if state_dir.is_dir():
        for p in state_dir.iterdir():
            m = _NAME.match(p.name)
            if m and p.is_dir():
                found.append(((int(m[1]), int(m[2] or 0)), p))
    return sorted(found)


def directory(out: str | os.PathLike, state_dir: str = "") -> Path:
    """Where the states of a run in ``out`` live: ``state_dir`` (``runtime.state_dir``, run.sh's
    CKPT_DIR) when set, else ``out/state``."""
    return Path(state_dir) if state_dir else Path(out) / STATE_DIR


def find(out: str | os.PathLike, state_dir: str = "") -> Path | None:
    """The state a run in ``out`` resumes from (a directory, or an older version's file), or None."""
    state_dir = directory(out, state_dir)
    states = _states(state_dir)
    if states:
        return states[-1][1]
    legacy = state_dir / LEGACY_FILE
    return legacy if legacy.is_file() else None


def peek(out: str | os.PathLike, state_dir: str = "") -> dict | None:
    """What the state of ``out`` says (``step``, ``elapsed_s``, ``data_pos``, ``config``, ...; its
    ``path``), without reading its tensors; None for a fresh run. Raises ``RunError`` if it is damaged."""
    path = find(out, state_dir)
    if path is None:
        return None
    try:
        if path.is_file():  # legacy: memory-mapped, so cheap to peek at
            state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
            return {**state, "format": 1, "path": path}
        meta = torch.load(path / META, map_location="cpu", weights_only=False)
    except Exception as e:  # written atomically, so this is damage from outside, not a crash of ours
        raise RunError(f"trainer state {path} cannot be read ({type(e).__name__}: {e}); "
                       "move it away to start this run from scratch, or use another output directory") from None
    return {**meta, "path": path}


# --- the tensors: DCP state dicts of the run --------------------------------------------------


def _state_dicts(run: Run, parts=("model", "optimizer", "ema")) -> dict:
    """{"model", "optimizer", "ema"} (those of ``parts`` the run has): the run's tensors by name, as
    they live (DTensor shards of a sharded run; the parameters themselves otherwise: no copies). An
    optimizer that has not stepped gets its state created (a zero step at lr 0, which changes no
    weight) so that ``restore`` has tensors to read into."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    out = {}
    if "model" in parts:  # LoRA: the adapter alone
        out["model"] = _one_name_each(run.student, get_model_state_dict(
            run.student, options=StateDictOptions(ignore_frozen_params=True)))
    if "optimizer" in parts:
        out["optimizer"] = get_optimizer_state_dict(run.student, run.optimizer)
    if "ema" in parts and run.ema is not None:
        out["ema"] = _one_name_each(run.ema, get_model_state_dict(run.ema))
    return out


def _one_name_each(model, sd: dict) -> dict:
    """``sd`` without the second names of tied parameters (a tied head is the embedding: stored once)."""
    first = {n for n, _ in model.named_parameters()}
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - first
    return {k: v for k, v in sd.items() if k not in aliases}


def _size_on_disk(tree) -> int:
    """About the bytes a state of the tensors in ``tree`` takes: theirs at their global shapes (a
    DTensor counts whole), plus ~2 KiB of framing and index per tensor."""
    if isinstance(tree, dict):
        return sum(_size_on_disk(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_size_on_disk(v) for v in tree)
    return tree.numel() * tree.element_size() + 2048 if isinstance(tree, torch.Tensor) else 0


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns on every call without a process group that it assumes one process: it does."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _checkpoint_error(e: BaseException) -> BaseException:
    """DCP reports a rank's failure, on every rank, as a ``CheckpointException`` holding each failed
    rank's exception: the first ``OSError`` among them (so that retries and the storage explanations
    see its errno), else the exception itself."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, CheckpointException):
        for exc, _trace in e.failures.values():
            if isinstance(exc, OSError):
                return exc
    return e


# --- saving -----------------------------------------------------------------------------------


def save(out: Path, run: Run, step: int, elapsed: float, data_pos: int, log, pending: dict | None = None) -> Path:
    """Write the run's state at ``step`` into ``directory(out, runtime.state_dir)`` (every rank calls
    it: each writes its own shards; rank 0 writes ``meta.pt`` and publishes the directory). Returns its path.
    ``pending``: ``rollout.overlap``'s batch prefetched for the next step (``opdkit.overlap``), kept in
    ``meta.pt`` so that a resumed run trains on the batch it would have."""
    world = distributed.current()
    state_dir = directory(out, run.cfg.runtime.state_dir)
    tensors = _state_dicts(run)
    meta = {
        "format": FORMAT, "step": step, "elapsed_s": elapsed, "data_pos": data_pos,
        "lr_clock_start_s": run.extras["lr_clock_start_s"],
        "lora": run.cfg.lora.enabled, "ema": run.ema is not None,
        "rng": torch.get_rng_state(),
        "rng_cuda": torch.cuda.get_rng_state_all() if run.device.type == "cuda" else None,
        "config": to_dict(run.cfg), "data_fingerprint": run.inputs.data_fingerprint, "pending_rollout": pending,
    }  # fmt: skip
    what, size = f"the trainer state at step {step}", _size_on_disk(tensors)
    p = run.cfg.publish
    with explain_storage_errors(state_dir, size, what):  # a full disk is not retried
        path = retry_io(lambda: _write(state_dir, tensors, meta, size, world), retries=p.retries,
                        backoff_s=p.backoff_s, what=f"saving {what}", log=log)
    if world.is_main:
        _remove_all_but(state_dir, path)
    return path


def _write(state_dir: Path, tensors: dict, meta: dict, size: int, world: distributed.World) -> Path:
    """One attempt, on every rank; raises the same ``OSError`` on every rank if any rank's write fails
    (its temporary directory removed), so that every rank takes the same retry decision."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    tmp = None
    if world.is_main:
        state_dir.mkdir(parents=True, exist_ok=True)
        tmp = state_dir / f".tmp-trainer_state-{meta['step']}-{os.getpid()}-{time.monotonic_ns()}"
    tmp = Path(world.from_main(str(tmp)))  # one directory for all ranks (a shared one on several nodes)
    try:
        with _single_process_quiet():
            dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True),
                     no_dist=not world.active)
    except (Exception, CheckpointException) as e:  # every rank gets DCP's verdict on every rank's write
        err, failed = _checkpoint_error(e), None
        if world.is_main:
            if not isinstance(err, OSError) and _free_bytes(state_dir) < size:  # torch.save's zip writer reports a
                err = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))  # short write, not the errno
            shutil.rmtree(tmp, ignore_errors=True)
            failed = (err.errno, err.strerror or str(err), err.filename) if isinstance(err, OSError) else None
        failed = world.from_main(failed)
        if failed:
            raise OSError(*failed) from None
        raise err from None
    final, failed = None, None
    if world.is_main:
        try:
            final = _publish(state_dir, tmp, meta)
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            failed = (e.errno, e.strerror or str(e), e.filename)
    final, failed = world.from_main((str(final) if final else None, failed))
    if failed:
        raise OSError(*failed)
    return Path(final)


def _free_bytes(directory: Path) -> int:
    try:
        st = os.statvfs(directory)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def _publish(state_dir: Path, tmp: Path, meta: dict) -> Path:
    """``meta.pt`` into the written ``tmp``, everything fsynced, then ``tmp`` renamed to the state's name."""
    with open(tmp / META, "wb") as f:
        torch.save(meta, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_tree(tmp)
    taken = {key for key, _ in _states(state_dir)}
    n = next(i for i in range(len(taken) + 1) if (meta["step"], i) not in taken)  # a second save of one step: a new name
    final = state_dir / (f"trainer_state-{meta['step']}" + (f".{n}" if n else ""))
    os.rename(tmp, final)
    fsync_dir(state_dir)
    return final


def _remove_all_but(state_dir: Path, keep: Path) -> None:
    """Once ``keep`` is in place: the older states, an older version's file, and what interrupted
    saves left behind."""
    for p in state_dir.iterdir():
        if p == keep:
            continue
        if _NAME.match(p.name) or p.name.startswith(".tmp-trainer_state-"):
            shutil.rmtree(p, ignore_errors=True)
        elif p.name == LEGACY_FILE:
            p.unlink(missing_ok=True)
    fsync_dir(state_dir)


# --- restoring --------------------------------------------------------------------------------


def load_model(run: Run, state: dict) -> None:
    """The state's trainable weights (all, or the LoRA adapter) into ``run.student`` (unsharded)."""
    _load(run, state, parts=("model",))


def restore(run: Run, state: dict) -> None:
    """Everything of ``state`` into the unsharded ``run``: weights, optimizer, EMA teacher, RNG.
    Each rank reads the whole state (full tensors, no collectives); call it before sharding."""
    _load(run, state, parts=("model", "optimizer", "ema"))
    torch.set_rng_state(state["rng"])
    if state.get("rng_cuda") is not None and run.device.type == "cuda":
        torch.cuda.set_rng_state_all(state["rng_cuda"])


def _load(run: Run, state: dict, parts: tuple[str, ...]) -> None:
    if state["format"] == 1:  # an older version's single file: full tensors, the optimizer by parameter index
        load_trainable_state(run.student, state["model"])
        if "optimizer" in parts:
            run.optimizer.load_state_dict(state["optimizer"])
        if "ema" in parts and run.ema is not None and state.get("ema"):
            run.ema.load_state_dict(state["ema"])
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    tensors = _state_dicts(run, parts)
    with _single_process_quiet():
        dcp.load(tensors, storage_reader=dcp.FileSystemReader(state["path"]), no_dist=True)  # into these tensors
    # (DCP has already refused a state that lacks any of these tensors; strict=False: tied names are stored once)
    set_model_state_dict(run.student, tensors["model"], options=StateDictOptions(ignore_frozen_params=True, strict=False))
    if "optimizer" in tensors:
        set_optimizer_state_dict(run.student, run.optimizer, tensors["optimizer"])
    if "ema" in tensors:
        set_model_state_dict(run.ema, tensors["ema"], options=StateDictOptions(strict=False))
