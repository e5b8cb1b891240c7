"""The trainer state: what resuming a run needs, streamed to disk at disk speed and published atomically.

Layout, under a run's output directory (or ``runtime.state_dir``, run.sh's CKPT_DIR, when set)::

    state/trainer_state-<step>/     one complete state; a run resumes from the newest step's
        meta.pt                     step, elapsed wall time, data position, lr clock, RNG, the params
                                    and data fingerprint, the state dicts' values that are not tensors
                                    (the optimizer's param groups), the number of ranks (small; ``peek``
                                    reads only this)
        rank<r>.bin, rank<r>.json   rank r's tensors, raw bytes (``opdkit.persist.tensor_files``), and where each
                                    lies: ``model`` (the trainable weights: all of them, or the LoRA adapter
                                    alone), ``optimizer`` (its state by parameter name), ``ema`` (an EMA
                                    teacher's weights), each piece with its global shape and offset

Streaming: each tensor is written from where it lives, a GPU one through a few reused pinned
buffers whose copies overlap the writes, so a save holds no second copy of the state in host memory
and runs at the file system's speed. Under torchrun every rank writes its own shards, in parallel;
nothing is gathered. Tensors are stored by name with their global shapes and offsets, so a state
resumes under any number of ranks (``restore`` reads full tensors into the unsharded run before
it is sharded), one process included.

Atomic: a state is written into ``state/.tmp-trainer_state-<step>-<pid>-<ns>``, every file fsynced
(``meta.pt`` last), then renamed into place; older states beyond the newest ``publish.keep_states``
and leftovers of interrupted saves are removed only after that, a leftover only by the process
that made it or once that process is gone. A state directory is complete or absent. Transient I/O
errors are retried (``publish.retries``, ``fsutil.retry_io``) by every rank together; a full disk,
a quota or a read-only file system is not, and the error names the directory and the bytes needed.

Older formats are still read: the torch.distributed.checkpoint directories of the previous
version (``.metadata``, ``__<r>_0.distcp``) and the single file before that
(``state/trainer_state.pt``); the first save replaces them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
import warnings
from pathlib import Path

import torch

from opdkit import distributed
from opdkit.config import to_dict
from opdkit.persist import tensor_files
from opdkit.persist.fsutil import explain_storage_errors, fsync_dir, fsync_tree, pid_alive, retry_io
from opdkit.setup import Run, RunError, load_trainable_state

STATE_DIR = "state"
LEGACY_FILE = "trainer_state.pt"  # the single-file state of older versions
META = "meta.pt"
FORMAT = 3  # 1: the legacy single file; 2: a torch.distributed.checkpoint directory (still read)
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


def check_tensor_files(path: Path, ranks: int) -> None:
    """Every rank's tensor file of the state directory ``path`` (``ranks`` of them) and its index are there,
    and the file is as long as the index says: a state cut short or pruned is found when it is chosen, before
    a start records itself (config.yaml, run.json), not when its tensors are read. ``ValueError`` otherwise."""
    for r in range(ranks):
        index, data = path / f"rank{r}.json", path / f"rank{r}.bin"
        end = max((e["pos"] + e["nbytes"] for e in json.loads(index.read_text())), default=0)
        if data.stat().st_size < end:
            raise ValueError(f"{data.name} is {data.stat().st_size} bytes but {index.name} places tensors up to byte "
                             f"{end}: the file is truncated")


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
    try:
        check_tensor_files(path, meta.get("ranks", 0))  # (the previous version's DCP states: no ranks recorded)
    except (OSError, ValueError, KeyError, TypeError) as e:  # as _read_into would say it
        raise RunError(f"trainer state {path}: {e}; move {path} away to resume from an older state (or start "
                       "afresh), or use another output directory") from None
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


# --- saving -----------------------------------------------------------------------------------


def _flatten(tree, prefix: tuple = ()):
    """(path, leaf) of a nested state dict: dicts are walked, and lists holding dicts, lists or tensors
    (the optimizer's ``param_groups``); anything else (a number, a tuple of betas, a list of names) is a leaf."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flatten(v, (*prefix, k))
    elif isinstance(tree, list) and any(isinstance(v, (dict, list, torch.Tensor)) for v in tree):
        for i, v in enumerate(tree):
            yield from _flatten(v, (*prefix, i))
    else:
        yield prefix, tree


def _set(tree, path: tuple, value) -> None:
    for k in path[:-1]:
        tree = tree[k]
    tree[path[-1]] = value


def _pieces(tensors: dict, world: distributed.World):
    """(key, tensor, global shape, global offset) of what this rank writes: its shard of each DTensor
    (once per replica set), and the plain tensors on rank 0."""
    for path, t in _flatten(tensors):
        if not isinstance(t, torch.Tensor):
            continue
        key = list(path)
        if hasattr(t, "to_local") and hasattr(t, "placements"):  # a DTensor: this rank's shard, at its global offset
            from torch.distributed.tensor import Replicate
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            coord = t.device_mesh.get_coordinate()
            if coord is None or any(isinstance(p, Replicate) and c for p, c in zip(t.placements, coord)):
                continue  # not in the mesh, or a replica another rank writes
            local = t.to_local()
            shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
            if tuple(shape) != tuple(local.shape):
                raise RuntimeError(f"trainer state: {'.'.join(map(str, path))} has a local shard of shape "
                                   f"{list(local.shape)} where its placement gives {list(shape)}")
            if local.numel():
                yield key, local, list(t.shape), list(offset)
        elif world.is_main:
            yield key, t, list(t.shape), [0] * t.dim()


def _objects(tensors: dict) -> dict[str, object]:
    """The leaves that are not tensors (the optimizer's param_groups values, ...), by their path as JSON."""
    return {json.dumps(list(path)): v for path, v in _flatten(tensors) if not isinstance(v, torch.Tensor)}


def save(out: Path, run: Run, step: int, elapsed: float, data_pos: int, log, pending: dict | None = None) -> Path:
    """Write the run's state at ``step`` into ``directory(out, runtime.state_dir)`` (every rank calls
    it: each writes its own shards; rank 0 writes ``meta.pt`` and publishes the directory). Returns its path.
    ``pending``: ``rollout.overlap``'s batch prefetched for the next step (``opdkit.overlap``), kept in
    ``meta.pt`` so that a resumed run trains on the batch it would have. The newest
    ``publish.keep_states`` states are kept."""
    world = distributed.current()
    state_dir = directory(out, run.cfg.runtime.state_dir)
    tensors = _state_dicts(run)
    meta = {
        "format": FORMAT, "step": step, "elapsed_s": elapsed, "data_pos": data_pos,
        "lr_clock_start_s": run.lr_clock_start_s,
        "lora": run.cfg.lora.enabled, "ema": run.ema is not None,
        "rng": torch.get_rng_state(),
        "rng_cuda": torch.cuda.get_rng_state_all() if run.device.type == "cuda" else None,
        "config": to_dict(run.cfg), "data_fingerprint": run.inputs.data_fingerprint, "pending_rollout": pending,
        "ranks": world.size, "objects": _objects(tensors), "run_id": run.run_id,
    }  # fmt: skip
    what, size = f"the trainer state at step {step}", _size_on_disk(tensors)
    p = run.cfg.publish
    with explain_storage_errors(state_dir, size, what):  # a full disk is not retried
        path = retry_io(lambda: _write(state_dir, tensors, meta, size, world), retries=p.retries,
                        backoff_s=p.backoff_s, what=f"saving {what}", log=log)
    if world.is_main:
        _remove_all_but(state_dir, path, p.keep_states)
    return path


def _write(state_dir: Path, tensors: dict, meta: dict, size: int, world: distributed.World) -> Path:
    """One attempt, on every rank; raises the same ``OSError`` on every rank if any rank's write fails
    (its temporary directory removed), so that every rank takes the same retry decision."""
    tmp = None
    if world.is_main:
        state_dir.mkdir(parents=True, exist_ok=True)
        tmp = state_dir / f".tmp-trainer_state-{meta['step']}-{os.getpid()}-{time.monotonic_ns()}"
        tmp.mkdir()
    tmp = Path(world.from_main(str(tmp)))  # one directory for all ranks (a shared one on several nodes); made
    failed = None
    try:
        entries, _ = tensor_files.write_file(tmp / f"rank{world.rank}.bin", _pieces(tensors, world))
        with open(tmp / f"rank{world.rank}.json", "w") as f:
            json.dump(entries, f)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        failed = ("os", e.errno, e.strerror or str(e), e.filename)
    except Exception as e:  # reported to every rank, so that none waits for this one in the next collective
        failed = ("other", f"{type(e).__name__}: {e}")
    failures = [f for f in world.gather(failed) if f is not None]
    if failures:
        if world.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        first = failures[0]
        if first[0] == "os":
            raise OSError(*first[1:])
        raise RuntimeError(f"saving the trainer state failed on a rank: {first[1]}")
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
    # a second save of one step: a new name
    n = next(i for i in range(len(taken) + 1) if (meta["step"], i) not in taken)
    final = state_dir / (f"trainer_state-{meta['step']}" + (f".{n}" if n else ""))
    os.rename(tmp, final)
    fsync_dir(state_dir)
    return final


_TMP = re.compile(r"^\.tmp-trainer_state-\d+-(\d+)-\d+$")


def _remove_all_but(state_dir: Path, keep: Path, keep_states: int = 1) -> None:
    """Once ``keep`` is in place: the states older than the newest ``keep_states`` (``keep`` always
    among the kept), an older version's file, and what interrupted saves left behind (a temporary
    directory is removed only by the process that made it or once that process is gone)."""
    states = [p for _, p in _states(state_dir) if p != keep]
    for p in states[:max(0, len(states) - (keep_states - 1))]:
        shutil.rmtree(p, ignore_errors=True)
    for p in state_dir.iterdir():
        m = _TMP.match(p.name)
        if m and (int(m[1]) == os.getpid() or not pid_alive(int(m[1]))):
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
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    tensors = _state_dicts(run, parts)
    if state["format"] == 2:  # an older version's torch.distributed.checkpoint directory
        import torch.distributed.checkpoint as dcp

        with _single_process_quiet():
            dcp.load(tensors, storage_reader=dcp.FileSystemReader(state["path"]), no_dist=True)  # into these tensors
    else:
        _read_into(tensors, state)
    # (a state that lacks any of these tensors was refused above; strict=False: tied names are stored once)
    set_model_state_dict(run.student, tensors["model"],
                         options=StateDictOptions(ignore_frozen_params=True, strict=False))
    if "optimizer" in tensors:
        set_optimizer_state_dict(run.student, run.optimizer, tensors["optimizer"])
    if "ema" in tensors:
        set_model_state_dict(run.ema, tensors["ema"], options=StateDictOptions(strict=False))


def _read_into(tensors: dict, state: dict) -> None:
    """Fill ``tensors`` (the run's state dicts, unsharded) from a state directory: each tensor from the
    pieces every rank wrote (any number of ranks), each other value from ``meta.pt``."""
    path = Path(state["path"])
    pieces: dict[tuple, list] = {}
    files = [path / f"rank{r}.bin" for r in range(state["ranks"])]
    try:
        for r, f in enumerate(files):
            for e in json.loads((path / f"rank{r}.json").read_text()):
                pieces.setdefault(tuple(e["key"]), []).append((f, e))
        for key, leaf in list(_flatten(tensors)):
            what = f"trainer state {path}: {'.'.join(map(str, key))}"
            if isinstance(leaf, torch.Tensor):
                if key not in pieces:
                    raise ValueError(f"{what} is missing (a state of another model or run?)")
                with torch.no_grad():
                    tensor_files.assemble(leaf, pieces[key], what)
            elif json.dumps(list(key)) in state["objects"]:
                _set(tensors, key, state["objects"][json.dumps(list(key))])
    except (OSError, ValueError, KeyError) as e:
        raise RunError(f"{e}; move {path} away to resume from an older state (or start afresh), or use another "
                       "output directory") from None
    finally:
        tensor_files.release(files)
