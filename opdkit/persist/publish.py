"""Checkpoint export and retention.

A checkpoint (its layout and what makes it valid: see ``opdkit.persist.checkpoints``) is published
atomically: written into ``ROOT/.tmp-checkpoint-<step>-<pid>``, fsynced, validated, then renamed
into place, so a ``checkpoint-*`` dir is either complete or absent, even if the process is
SIGKILLed. A whole attempt is retried on transient file-system errors (see
``fsutil.retry_io``). Old checkpoints are pruned only after the new one is in place.

``Publisher`` runs exports on one background thread; an export error is never lost: it is
re-raised as ``PublishError`` by the next ``submit()``, ``check()``, ``wait()`` or ``close()``.

The weights are written in the export dtype (``export_dtype``: the source model's own, bf16 for
real checkpoints, unless ``publish.dtype`` says otherwise), split into shards of at most
``max_shard_size`` with a ``model.safetensors.index.json`` as ``save_pretrained`` does (the shard
plan is huggingface_hub's ``split_torch_state_dict_into_shards``; the bytes are written by our
own writer in ``opdkit.persist.weights_io``, whose ``OSError`` keeps its errno for the retry decision). A tensor
that is NaN or infinite after the cast is never written (``NonFiniteTensor``, before the disk is touched). A full
disk or read-only file system is not retried and says how much space the export needs.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from opdkit.persist.checkpoints import (
    FORMAT,
    MANIFEST,
    WEIGHTS,
    WEIGHTS_INDEX,
    ModelSpec,
    NonFiniteTensor,
    file_record,
    is_valid_checkpoint,
    model_spec,
    nonfinite_names,
    surviving_checkpoints_message,
    validate_checkpoint,
)
from opdkit.persist.fsutil import (
    explain_storage_errors,
    fsync_dir,
    fsync_tree,
    list_checkpoints,
    pid_alive,
    retry_io,
    step_of,
)
from opdkit.persist.weights_io import (
    shard_plan,
    write_index,
    write_safetensors as _write_safetensors,  # a name tests patch to inject I/O faults
)

_TMP_RE = re.compile(r"^\.tmp-checkpoint-(\d+)-(\d+)(?:-(old|del))?$")

Log = Callable[[str], Any]


class PublishError(RuntimeError):
    """A checkpoint could not be published (the message says which checkpoints survive)."""


# --- export -----------------------------------------------------------------------------------

_in_progress: set[str] = set()  # temp dirs this process is writing right now (never "stale")
_in_progress_lock = threading.Lock()


def export_checkpoint(
    root: Path,
    step: int,
    *,
    state_dict: dict[str, torch.Tensor],
    model_config,
    tokenizer,
    generation_config,
    meta: dict,
    keep: int,
    retries: int,
    backoff_s: float,
    dtype: torch.dtype | None = None,
    max_shard_size: str | int = "5GB",
    log: Log = print,
) -> Path:
    """Publish ``root/checkpoint-<step>/`` atomically, then keep only the newest ``keep``.

    ``state_dict`` holds CPU tensors that nothing else mutates meanwhile (the caller snapshots,
    e.g. ``{k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}``), with
    the plain HF model's names (merge LoRA adapters first). Tied weights (``lm_head`` ==
    embeddings) are stored once, as ``save_pretrained`` does. ``generation_config`` may be None
    (derived from ``model_config``). Floating tensors are cast to ``dtype`` (None: as given) and
    must be finite, else ``NonFiniteTensor`` is raised before anything is written; the weights are
    sharded at ``max_shard_size``. An existing ``checkpoint-<step>`` is replaced atomically.
    Retention always keeps the new checkpoint plus the ``keep - 1`` newest other valid ones;
    invalid ``checkpoint-*`` dirs older than those are removed too, and stale temp dirs of
    killed runs are cleaned. Raises the last ``OSError`` after ``retries`` transient failures.
    """
    if keep < 1:
        raise ValueError(f"publish.keep must be >= 1, got {keep}")
    root, step = Path(root), int(step)
    json.dumps(meta)  # not JSON-serialisable: fail now, before touching the disk
    final = root / f"checkpoint-{step}"
    tmp = root / f".tmp-checkpoint-{step}-{os.getpid()}"
    spec = model_spec(model_config)
    tensors = _tensors_to_save(state_dict, spec, dtype)
    shards = shard_plan(tensors, max_shard_size)
    if dtype is not None:
        model_config = copy.deepcopy(model_config)
        model_config.dtype = dtype  # config.json says what the weights are
    t0 = time.monotonic()
    size_bytes = 0
    need_bytes = sum(t.numel() * t.element_size() for t in tensors.values()) + 2**20  # + config, tokenizer

    def attempt() -> None:
        nonlocal size_bytes
        try:
            with explain_storage_errors(root if root.is_dir() else root.parent, need_bytes, f"checkpoint-{step}"):
                root.mkdir(parents=True, exist_ok=True)
                _write_checkpoint_dir(tmp, step, shards, model_config, tokenizer, generation_config, meta, spec)
                validate_checkpoint(tmp, full=False)  # never publish something we would reject
                size_bytes = sum(f.stat().st_size for f in tmp.iterdir())
                _install(tmp, final, log)
        except BaseException:
            _remove_tree_quietly(tmp, log)
            raise

    names = {str(tmp), f"{tmp}-old"}
    with _in_progress_lock:
        _in_progress.update(names)
    try:
        retry_io(attempt, retries=retries, backoff_s=backoff_s, what=f"writing {final}", log=log)
    finally:
        with _in_progress_lock:
            _in_progress.difference_update(names)
    dt = time.monotonic() - t0
    log(f"published {final} ({size_bytes / 2**20:.1f} MiB in {dt:.1f}s, {size_bytes / 1e9 / max(dt, 1e-9):.2f} GB/s)")
    try:
        retry_io(lambda: _apply_retention(root, keep, step, log), retries=retries, backoff_s=backoff_s,
                 what=f"pruning old checkpoints in {root}", log=log)  # fmt: skip
    except OSError as exc:
        exc.add_note(f"{final.name} itself was published; removing older checkpoints failed")
        raise
    return final


def _tensors_to_save(state_dict: dict[str, torch.Tensor], spec: ModelSpec,
                     dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Check the tensors are CPU snapshots, drop tied duplicates (e.g. ``lm_head.weight``), cast
    floating ones to ``dtype`` and check every value is finite (in memory: the file is never read)."""
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state_dict[{name!r}] is a {type(t).__name__}, expected a tensor")
        if t.device.type != "cpu" or t.requires_grad:
            raise ValueError(
                f"state_dict[{name!r}] is a live {t.device} tensor; pass CPU snapshots, e.g. "
                f"{{k: v.detach().to('cpu', copy=True) for k, v in model.state_dict().items()}}"
            )
    tensors = dict(state_dict)
    for target, source in spec.tied.items():
        if target in tensors and source in tensors and _same_values(tensors[target], tensors[source]):
            del tensors[target]
    for name, t in tensors.items():
        if t.is_floating_point() and dtype is not None and t.dtype != dtype:
            tensors[name] = t.to(dtype)
    bad = nonfinite_names(tensors)
    if bad:
        name = bad[0]
        raise NonFiniteTensor(name, f"tensor {name} has NaN or infinite values (in {tensors[name].dtype}); "
                              "it is not published")
    return tensors


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    same_view = a.data_ptr() == b.data_ptr() and a.stride() == b.stride()
    return same_view or torch.equal(a, b)


def _write_checkpoint_dir(tmp, step, shards, model_config, tokenizer, generation_config, meta, spec) -> None:
    if tmp.exists():
        shutil.rmtree(tmp)  # left by a failed attempt of ours
    tmp.mkdir()
    config = copy.deepcopy(model_config)
    if not getattr(config, "architectures", None):
        config.architectures = [spec.architecture]  # vLLM and others dispatch on it
    config.save_pretrained(tmp)
    records = {}
    for file, tensors in shards.items():  # the writer hashes while it writes: no second read of the weights
        records[file] = _write_safetensors(tmp / file, tensors) or file_record(tmp / file)
    if list(shards) != [WEIGHTS]:
        write_index(tmp / WEIGHTS_INDEX, shards)
    tokenizer.save_pretrained(tmp)
    if generation_config is None:
        from transformers import GenerationConfig

        generation_config = GenerationConfig.from_model_config(model_config)
    generation_config.save_pretrained(tmp)
    files = {p.name: records.get(p.name) or file_record(p) for p in sorted(tmp.iterdir()) if p.is_file()}
    manifest = {**meta, "step": step, "format": FORMAT, "files": files}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    fsync_tree(tmp)


def _install(tmp: Path, final: Path, log: Log) -> None:
    """Rename the finished temp dir to ``final``; an existing ``final`` is swapped out first."""
    if not final.exists():
        os.rename(tmp, final)
        fsync_dir(final.parent)
        return
    log(f"replacing existing {final}")
    aside = Path(f"{tmp}-old")  # if we die before the swap completes, the next export restores it
    if aside.exists():
        shutil.rmtree(aside)
    os.rename(final, aside)
    try:
        os.rename(tmp, final)
    except BaseException:
        os.rename(aside, final)
        raise
    fsync_dir(final.parent)
    _remove_tree_quietly(aside, log)


def _remove_tree_quietly(path: Path, log: Log) -> None:
    """Best-effort cleanup on a path that is already failing; leftovers are removed later."""
    try:
        if path.exists():
            shutil.rmtree(path)
    except OSError as exc:
        log(f"could not remove {path} ({exc}); the next export will retry")


# --- retention --------------------------------------------------------------------------------


def _apply_retention(root: Path, keep: int, new_step: int, log: Log) -> None:
    _clean_stale_temp_dirs(root, log)
    valid, invalid = [], []
    for path in list_checkpoints(root):
        if step_of(path) == new_step:
            continue
        ok, reason = is_valid_checkpoint(path, full=False)
        (valid if ok else invalid).append((path, reason))
    valid.sort(key=lambda pr: step_of(pr[0]), reverse=True)
    kept_steps = [new_step] + [step_of(p) for p, _ in valid[: keep - 1]]
    for path, _ in valid[keep - 1 :]:
        _delete_checkpoint(path, f"keeping the newest {keep}", log)
    for path, reason in invalid:
        if step_of(path) < min(kept_steps):
            _delete_checkpoint(path, f"invalid: {reason}", log)
        else:
            log(f"warning: leaving {path} alone although it is invalid ({reason})")


def _delete_checkpoint(path: Path, why: str, log: Log) -> None:
    # Rename first: a half-deleted dir must never carry a checkpoint-* name.
    doomed = path.with_name(f".tmp-checkpoint-{step_of(path)}-{os.getpid()}-del")
    if doomed.exists():
        shutil.rmtree(doomed)
    os.rename(path, doomed)
    fsync_dir(path.parent)
    shutil.rmtree(doomed)
    log(f"removed {path.name} ({why})")


def _clean_stale_temp_dirs(root: Path, log: Log) -> None:
    """Remove ``.tmp-checkpoint-*`` dirs of dead writers; restore a swapped-out checkpoint whose
    replacement never arrived. Dirs of live processes other than us are left alone."""
    for entry in sorted(root.iterdir()):
        m = _TMP_RE.match(entry.name)
        with _in_progress_lock:
            ours_now = str(entry) in _in_progress
        if m is None or ours_now or (int(m[2]) != os.getpid() and pid_alive(int(m[2]))):
            continue
        final = root / f"checkpoint-{m[1]}"
        if m[3] == "old" and not final.exists() and is_valid_checkpoint(entry, full=False)[0]:
            os.rename(entry, final)
            fsync_dir(root)
            log(f"restored {final.name} from {entry.name} (a replacement was interrupted)")
            continue
        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        log(f"removed stale temp dir {entry.name}")


# --- background publishing --------------------------------------------------------------------


class Snapshot:
    """The export's host copy of the weights (``copy(name, tensor)``, for ``engines.weights.export_state_dict``):
    a GPU tensor is copied into pinned host memory kept from one export to the next (the copies are
    queued at the bus's speed; ``done`` waits for them), a CPU tensor into a new tensor. Reusing the
    memory is safe because the caller snapshots only once the previous export has finished
    (``Publisher.wait``)."""

    def __init__(self):
        self.arena: dict[str, torch.Tensor] = {}
        self.queued = False

    def copy(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "cuda":
            return t.detach().to("cpu", copy=True)
        buf = self.arena.get(name)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self.arena[name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        buf.copy_(t.detach(), non_blocking=True)
        self.queued = True
        return buf

    def done(self) -> None:
        if self.queued:
            torch.cuda.synchronize()
            self.queued = False


class Publisher:
    """Exports checkpoints on one background thread (``background=False``: inline).

        pub = Publisher(out / "checkpoints", keep=3, retries=5, backoff_s=0.5)
        pub.submit(step, state_dict=snapshot, model_config=model.config, tokenizer=tok,
                   generation_config=model.generation_config, meta={...})
        ...
        pub.close()  # waits; raises PublishError if any export failed

    At most one export runs; ``submit`` first waits for the previous one. The caller must hand
    over CPU snapshots of the weights (see ``export_checkpoint``); config, tokenizer,
    generation config and meta are copied in ``submit``. A failure is sticky: every later
    ``submit``/``check``/``wait``/``close`` raises ``PublishError`` chained to the cause.
    """

    def __init__(
        self, root, *, keep: int, retries: int, backoff_s: float, max_shard_size: str | int = "5GB",
        background: bool = True, log: Log = print
    ):
        if keep < 1:
            raise ValueError(f"publish.keep must be >= 1, got {keep}")
        self.root = Path(root)
        self.keep, self.retries, self.backoff_s = keep, retries, backoff_s
        self.max_shard_size = max_shard_size
        self.background, self.log = background, log
        self.published: list[int] = []  # steps, in publishing order
        self.timings: list[dict] = []  # per finished export: step, seconds (from ``started_at``), bytes
        self.snapshot = Snapshot()
        self._thread: threading.Thread | None = None
        self._pending_step: int | None = None
        self._failure: tuple[str, BaseException] | None = None
        self._closed = False

    def submit(self, step: int, *, state_dict, model_config, tokenizer, generation_config, meta: dict,
               dtype: torch.dtype | None = None, started_at: float | None = None) -> None:
        """Start publishing ``checkpoint-<step>``; first waits for (and checks) the previous one.
        ``started_at``: the ``time.monotonic()`` the export began (its snapshot), for ``timings``."""
        if self._closed:
            raise RuntimeError("Publisher.submit() after close()")
        if self.busy:
            self.log(f"waiting for the export of checkpoint-{self._pending_step} before submitting step {step}")
        self.wait()
        json.dumps(meta)  # fail here, in the caller's frame, if meta is not JSON-serialisable
        model_spec(model_config)  # warm the cache here so the export thread builds no model
        kwargs = dict(
            state_dict=state_dict,
            model_config=copy.deepcopy(model_config),
            tokenizer=copy.deepcopy(tokenizer),  # the training thread keeps using the original
            generation_config=copy.deepcopy(generation_config),
            meta=copy.deepcopy(meta),
            dtype=dtype,
        )
        started_at = time.monotonic() if started_at is None else started_at
        if not self.background:
            self._run(step, kwargs, started_at)
            self.check()
            return
        self._pending_step = step
        self._thread = threading.Thread(target=self._run, args=(step, kwargs, started_at),
                                        name=f"opdkit-publish-{step}")
        self._thread.start()

    def _run(self, step: int, kwargs: dict, started_at: float) -> None:
        try:
            final = export_checkpoint(self.root, step, keep=self.keep, retries=self.retries, backoff_s=self.backoff_s,
                                      max_shard_size=self.max_shard_size, log=self.log, **kwargs)  # fmt: skip
            try:
                nbytes = sum(f.stat().st_size for f in final.iterdir() if f.is_file())
            except OSError:  # published all the same; only the record of its size is lost
                nbytes = 0
            self.timings.append({"step": step, "seconds": time.monotonic() - started_at, "bytes": nbytes})
        except BaseException as exc:  # stored and re-raised on the caller's thread, never lost
            notes = "".join(f" ({note})" for note in getattr(exc, "__notes__", ()))
            what = str(exc) if isinstance(exc, (OSError, NonFiniteTensor)) else repr(exc)
            self._failure = (
                f"publishing checkpoint-{step} to {self.root} failed: {what}{notes}; "
                f"{surviving_checkpoints_message(self.root)}",
                exc,
            )
            if not self.background and not isinstance(exc, Exception):
                raise  # inline Ctrl-C / SystemExit stay what they are
        else:
            self.published.append(step)

    @property
    def busy(self) -> bool:
        """An export is running in the background."""
        return self._thread is not None and self._thread.is_alive()

    def check(self) -> None:
        """Raise ``PublishError`` if an export has failed (does not wait)."""
        if self._failure is not None:
            msg, cause = self._failure
            raise PublishError(msg) from cause

    def wait(self) -> None:
        """Wait for the pending export, then ``check()``."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.check()

    def close(self) -> None:
        """Wait for the pending export; raise ``PublishError`` if any export failed. Idempotent."""
        self._closed = True
        self.wait()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
            return
        try:  # already failing: finish the pending export, report its error, keep the original
            self.close()
        except PublishError as publish_exc:
            if not isinstance(exc, PublishError):
                self.log(str(publish_exc))
