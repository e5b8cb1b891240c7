"""Checkpoint export, validation and retention.

A checkpoint is an ordinary HF directory ``ROOT/checkpoint-<step>/`` (config.json,
model.safetensors, tokenizer files, generation_config.json) plus ``opdkit.json`` (the caller's
``meta`` + step, format and every file's size and sha256). It is published atomically: written
into ``ROOT/.tmp-checkpoint-<step>-<pid>``, fsynced, checked, then renamed into place, so a
``checkpoint-*`` dir is either complete or absent, even if the process is SIGKILLed. A whole
attempt is retried on transient file-system errors (see ``fsutil.retry_io``). Old checkpoints
are pruned only after the new one is in place.

``Publisher`` runs exports on one background thread; an export error is never lost: it is
re-raised as ``PublishError`` by the next ``submit()``, ``check()``, ``wait()`` or ``close()``.

Validation (``validate_checkpoint``) first checks cheaply that every tensor the config's
architecture expects is in the safetensors headers with the right shape (so stubs and pruned
weights are caught without loading), then loads the model and tokenizer with ``Auto*``.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import shutil
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from opdkit.fsutil import fsync_dir, fsync_tree, is_transient, retry_io

FORMAT = 1
MANIFEST = "opdkit.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
TOKENIZER_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")
_TMP_RE = re.compile(r"^\.tmp-checkpoint-(\d+)-(\d+)(?:-(old|del))?$")
_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip
_ST_ITEMSIZE = {name: torch.empty((), dtype=dt).element_size() for dt, name in _ST_DTYPES.items()}

Log = Callable[[str], Any]


class PublishError(RuntimeError):
    """A checkpoint could not be published (the message says which checkpoints survive)."""


class InvalidCheckpoint(ValueError):
    def __init__(self, path: Path | str, reason: str):
        self.path, self.reason = Path(path), reason
        super().__init__(f"{path}: {reason}")


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
    log: Log = print,
) -> Path:
    """Publish ``root/checkpoint-<step>/`` atomically, then keep only the newest ``keep``.

    ``state_dict`` holds CPU tensors that nothing else mutates meanwhile (the caller snapshots,
    e.g. ``{k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}``), with
    the plain HF model's names (merge LoRA adapters first). Tied weights (``lm_head`` ==
    embeddings) are stored once, as ``save_pretrained`` does. ``generation_config`` may be None
    (derived from ``model_config``). An existing ``checkpoint-<step>`` is replaced atomically.
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
    spec = _model_spec(model_config)
    tensors = _tensors_to_save(state_dict, spec)
    t0 = time.monotonic()
    size_bytes = 0

    def attempt() -> None:
        nonlocal size_bytes
        try:
            root.mkdir(parents=True, exist_ok=True)
            _write_checkpoint_dir(tmp, step, tensors, model_config, tokenizer, generation_config, meta, spec)
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
    log(f"published {final} ({size_bytes / 2**20:.1f} MiB in {time.monotonic() - t0:.1f}s)")
    try:
        retry_io(lambda: _apply_retention(root, keep, step, log), retries=retries, backoff_s=backoff_s,
                 what=f"pruning old checkpoints in {root}", log=log)  # fmt: skip
    except OSError as exc:
        exc.add_note(f"{final.name} itself was published; removing older checkpoints failed")
        raise
    return final


def _tensors_to_save(state_dict: dict[str, torch.Tensor], spec: _ModelSpec) -> dict[str, torch.Tensor]:
    """Check the tensors are CPU snapshots and drop tied duplicates (e.g. ``lm_head.weight``)."""
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
    return tensors


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    same_view = a.data_ptr() == b.data_ptr() and a.stride() == b.stride()
    return same_view or torch.equal(a, b)


def _write_checkpoint_dir(tmp, step, tensors, model_config, tokenizer, generation_config, meta, spec) -> None:
    if tmp.exists():
        shutil.rmtree(tmp)  # left by a failed attempt of ours
    tmp.mkdir()
    config = copy.deepcopy(model_config)
    if not getattr(config, "architectures", None):
        config.architectures = [spec.architecture]  # vLLM and others dispatch on it
    config.save_pretrained(tmp)
    _write_safetensors(tmp / WEIGHTS, tensors)
    tokenizer.save_pretrained(tmp)
    if generation_config is None:
        from transformers import GenerationConfig

        generation_config = GenerationConfig.from_model_config(model_config)
    generation_config.save_pretrained(tmp)
    files = {p.name: _file_record(p) for p in sorted(tmp.iterdir()) if p.is_file()}
    manifest = {**meta, "step": step, "format": FORMAT, "files": files}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    fsync_tree(tmp)


def _file_record(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        sha256 = hashlib.file_digest(f, "sha256").hexdigest()
    return {"size": path.stat().st_size, "sha256": sha256}


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Write the safetensors format with plain Python I/O, so that a failing file system raises
    ``OSError`` with its errno (the Rust writer reports ``SafetensorError`` without one, and the
    retry decision needs the errno). Streams one tensor at a time; no second copy of the model."""
    # Larger itemsize first keeps every tensor aligned to its itemsize (the header is 8-aligned).
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in order:
        t = tensors[name]
        if t.dtype not in _ST_DTYPES:
            raise TypeError(f"tensor {name} has dtype {t.dtype}, which opdkit cannot save")
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]
        }  # fmt: skip
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for name in order:
            flat_u8 = tensors[name].detach().contiguous().reshape(-1).view(torch.uint8)  # raw bytes
            if flat_u8.numel():
                f.write(memoryview(flat_u8.numpy()))
        f.flush()
        os.fsync(f.fileno())


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
        if _step_of(path) == new_step:
            continue
        ok, reason = is_valid_checkpoint(path, full=False)
        (valid if ok else invalid).append((path, reason))
    valid.sort(key=lambda pr: _step_of(pr[0]), reverse=True)
    kept_steps = [new_step] + [_step_of(p) for p, _ in valid[: keep - 1]]
    for path, _ in valid[keep - 1 :]:
        _delete_checkpoint(path, f"keeping the newest {keep}", log)
    for path, reason in invalid:
        if _step_of(path) < min(kept_steps):
            _delete_checkpoint(path, f"invalid: {reason}", log)
        else:
            log(f"warning: leaving {path} alone although it is invalid ({reason})")


def _delete_checkpoint(path: Path, why: str, log: Log) -> None:
    # Rename first: a half-deleted dir must never carry a checkpoint-* name.
    doomed = path.with_name(f".tmp-checkpoint-{_step_of(path)}-{os.getpid()}-del")
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
        if m is None or ours_now or (int(m[2]) != os.getpid() and _pid_alive(int(m[2]))):
            continue
        final = root / f"checkpoint-{m[1]}"
        if m[3] == "old" and not final.exists() and is_valid_checkpoint(entry, full=False)[0]:
            os.rename(entry, final)
            fsync_dir(root)
            log(f"restored {final.name} from {entry.name} (a replacement was interrupted)")
            continue
        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        log(f"removed stale temp dir {entry.name}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --- background publishing --------------------------------------------------------------------


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
        self, root, *, keep: int, retries: int, backoff_s: float, background: bool = True, log: Log = print
    ):
        if keep < 1:
            raise ValueError(f"publish.keep must be >= 1, got {keep}")
        self.root = Path(root)
        self.keep, self.retries, self.backoff_s = keep, retries, backoff_s
        self.background, self.log = background, log
        self.published: list[int] = []  # steps, in publishing order
        self._thread: threading.Thread | None = None
        self._pending_step: int | None = None
        self._failure: tuple[str, BaseException] | None = None
        self._closed = False

    def submit(self, step: int, *, state_dict, model_config, tokenizer, generation_config, meta: dict) -> None:
        """Start publishing ``checkpoint-<step>``; first waits for (and checks) the previous one."""
        if self._closed:
            raise RuntimeError("Publisher.submit() after close()")
        if self.busy:
            self.log(f"waiting for the export of checkpoint-{self._pending_step} before submitting step {step}")
        self.wait()
        json.dumps(meta)  # fail here, in the caller's frame, if meta is not JSON-serialisable
        _model_spec(model_config)  # warm the cache here so the export thread builds no model
        kwargs = dict(
            state_dict=state_dict,
            model_config=copy.deepcopy(model_config),
            tokenizer=copy.deepcopy(tokenizer),  # the training thread keeps using the original
            generation_config=copy.deepcopy(generation_config),
            meta=copy.deepcopy(meta),
        )
        if not self.background:
            self._run(step, kwargs)
            self.check()
            return
        self._pending_step = step
        self._thread = threading.Thread(target=self._run, args=(step, kwargs), name=f"opdkit-publish-{step}")
        self._thread.start()

    def _run(self, step: int, kwargs: dict) -> None:
        try:
            export_checkpoint(self.root, step, keep=self.keep, retries=self.retries, backoff_s=self.backoff_s,
                              log=self.log, **kwargs)  # fmt: skip
        except BaseException as exc:  # stored and re-raised on the caller's thread, never lost
            notes = "".join(f" ({note})" for note in getattr(exc, "__notes__", ()))
            self._failure = (
                f"publishing checkpoint-{step} to {self.root} failed: {exc!r}{notes}; "
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


# --- validation -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _ModelSpec:
    architecture: str
    shapes: dict[str, tuple[int, ...]]  # every tensor the model's state_dict holds
    tied: dict[str, str]  # tied target -> source; a target may be absent from the weights
    ignore_missing: tuple[str, ...]  # regexes from the model class
    ignore_unexpected: tuple[str, ...]


_spec_cache: dict[str, _ModelSpec] = {}
_spec_lock = threading.Lock()


_SHAPE_IRRELEVANT_KEYS = {"architectures", "transformers_version", "dtype", "torch_dtype", "_name_or_path"}


def _model_spec(config) -> _ModelSpec:
    """Tensor names and shapes for ``config``, from a model skeleton on the meta device.

    Cached per config, ignoring keys that do not change shapes, so the in-memory config and the
    one read back from a checkpoint share an entry (``Publisher.submit`` fills it on the
    caller's thread: building a model briefly patches ``torch.nn.init`` process-wide).
    """
    config_dict = {k: v for k, v in config.to_dict().items() if k not in _SHAPE_IRRELEVANT_KEYS}
    key = json.dumps(config_dict, sort_keys=True, default=str)
    with _spec_lock:
        if key in _spec_cache:
            return _spec_cache[key]
    from transformers import AutoModelForCausalLM

    # dtype=None: no torch.set_default_dtype (process-global) while training runs on another
    # thread; the meta device context is thread-local. deepcopy: from_config mutates the config.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=None)
    cls = type(model)
    spec = _ModelSpec(
        architecture=cls.__name__,
        shapes={k: tuple(v.shape) for k, v in model.state_dict().items()},
        tied=dict(getattr(model, "all_tied_weights_keys", None) or {}),
        ignore_missing=tuple(cls._keys_to_ignore_on_load_missing or ()),
        ignore_unexpected=tuple(cls._keys_to_ignore_on_load_unexpected or ()),
    )
    with _spec_lock:
        if len(_spec_cache) >= 8:
            _spec_cache.clear()
        _spec_cache[key] = spec
    return spec


def validate_checkpoint(path, *, full: bool = True, check_hashes: bool = False) -> None:
    """Raise ``InvalidCheckpoint`` unless ``path`` is a complete, loadable HF checkpoint.

    Checks, in order: the dir, config.json, the ``opdkit.json`` file list (sizes; sha256 with
    ``check_hashes``), weights present and not truncated, every tensor the architecture expects
    present with the right shape and none unexpected, tokenizer files; with ``full`` also loads
    the tokenizer and the model (``AutoTokenizer``/``AutoModelForCausalLM``). A transient I/O
    error is raised as ``OSError`` (we cannot tell), not reported as invalid.
    """
    path = Path(path)
    try:
        _validate_structure(path, check_hashes)
        if full:
            _validate_by_loading(path)
    except OSError as exc:
        if is_transient(exc):
            raise
        raise InvalidCheckpoint(path, f"cannot read: {exc}") from exc


def is_valid_checkpoint(path, *, full: bool = True) -> tuple[bool, str]:
    """``(True, "ok")`` or ``(False, reason)``; never raises for a bad or unreadable dir."""
    try:
        validate_checkpoint(path, full=full)
    except InvalidCheckpoint as exc:
        return False, exc.reason
    except OSError as exc:
        return False, f"cannot read: {exc}"
    return True, "ok"


def _validate_structure(path: Path, check_hashes: bool) -> None:
    def bad(reason: str) -> InvalidCheckpoint:
        return InvalidCheckpoint(path, reason)

    if not path.is_dir():
        raise bad("does not exist" if not path.exists() else "is not a directory")
    if not (path / "config.json").is_file():
        raise bad("config.json is missing")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(path))
    except (ValueError, KeyError, TypeError) as exc:
        raise bad(f"config.json does not parse as an HF config: {exc}") from exc
    if (path / MANIFEST).is_file():
        _check_manifest(path, bad, check_hashes)
    shapes_in_file = _read_weight_shapes(path, bad)
    has_vocab = any((path / f).is_file() for f in TOKENIZER_VOCAB_FILES)
    if not (path / "tokenizer_config.json").is_file() or not has_vocab:
        raise bad(f"tokenizer files missing (need tokenizer_config.json and one of {', '.join(TOKENIZER_VOCAB_FILES)})")
    try:
        spec = _model_spec(config)
    except (ValueError, KeyError) as exc:
        raise bad(f"config.json does not describe a causal LM that transformers can build: {exc}") from exc
    for name, shape in spec.shapes.items():
        if name not in shapes_in_file:
            if name in spec.tied or any(re.search(p, name) for p in spec.ignore_missing):
                continue
            raise bad(f"tensor {name} {list(shape)} that {spec.architecture} expects is missing from the weights")
        if shapes_in_file[name] != shape:
            got = list(shapes_in_file[name])
            raise bad(f"tensor {name} has shape {got}; {spec.architecture} expects {list(shape)}")
    for name in shapes_in_file:
        if name not in spec.shapes and not any(re.search(p, name) for p in spec.ignore_unexpected):
            raise bad(f"unexpected tensor {name} in the weights: {spec.architecture} has no such parameter")


def _check_manifest(path: Path, bad, check_hashes: bool) -> None:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except ValueError as exc:
        raise bad(f"{MANIFEST} is not valid JSON: {exc}") from exc
    if manifest.get("format") != FORMAT:
        raise bad(f"{MANIFEST} has format {manifest.get('format')!r}; this opdkit reads format {FORMAT}")
    for name, record in manifest.get("files", {}).items():
        file = path / name
        if not file.is_file():
            raise bad(f"{name} is listed in {MANIFEST} but missing")
        if file.stat().st_size != record["size"]:
            raise bad(f"{name} is {file.stat().st_size} bytes; {MANIFEST} records {record['size']}")
        if check_hashes and _file_record(file)["sha256"] != record["sha256"]:
            raise bad(f"{name} does not match the sha256 recorded in {MANIFEST}")


def _read_weight_shapes(path: Path, bad) -> dict[str, tuple[int, ...]]:
    """All tensor shapes from the safetensors header(s); a single file or an index + shards."""
    if (path / WEIGHTS_INDEX).is_file():
        try:
            weight_map = json.loads((path / WEIGHTS_INDEX).read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise bad(f"{WEIGHTS_INDEX} is not a valid index: {exc!r}") from exc
        shapes: dict[str, tuple[int, ...]] = {}
        for shard in sorted(set(weight_map.values())):
            if not (path / shard).is_file():
                raise bad(f"weight shard {shard} named in {WEIGHTS_INDEX} is missing")
            shapes.update(_read_safetensors_header(path / shard, bad))
        for name, shard in weight_map.items():
            if name not in shapes:
                raise bad(f"tensor {name} is mapped to {shard} in {WEIGHTS_INDEX} but not stored there")
        return shapes
    if (path / WEIGHTS).is_file():
        return _read_safetensors_header(path / WEIGHTS, bad)
    raise bad(f"no model weights ({WEIGHTS} or {WEIGHTS_INDEX})")


def _read_safetensors_header(file: Path, bad) -> dict[str, tuple[int, ...]]:
    size = file.stat().st_size
    if size < 8:
        raise bad(f"{file.name} is {size} bytes: not a safetensors file (truncated?)")
    with open(file, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if 8 + header_len > size:
            raise bad(f"{file.name} is truncated: {size} bytes, header alone claims {header_len}")
        try:
            header = json.loads(f.read(header_len))
        except ValueError as exc:
            raise bad(f"{file.name} has a corrupt header: {exc}") from exc
    header.pop("__metadata__", None)
    shapes, data_end = {}, 0
    for name, entry in header.items():
        try:
            begin, end = entry["data_offsets"]
            shape, itemsize = tuple(int(d) for d in entry["shape"]), _ST_ITEMSIZE.get(entry["dtype"])
        except (KeyError, TypeError, ValueError) as exc:
            raise bad(f"{file.name} has a corrupt header entry for {name}: {exc!r}") from exc
        if itemsize is not None and end - begin != itemsize * torch.Size(shape).numel():
            raise bad(f"{file.name}: tensor {name} has {end - begin} bytes for shape {list(shape)}")
        shapes[name], data_end = shape, max(data_end, end)
    if 8 + header_len + data_end != size:
        raise bad(f"{file.name} is {size} bytes but its header describes {8 + header_len + data_end} (truncated?)")
    return shapes


def _validate_by_loading(path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # any failure to load = not a usable checkpoint (reason kept)
        if is_transient(exc):
            raise
        raise InvalidCheckpoint(path, f"tokenizer does not load: {exc!r}") from exc
    try:
        model, info = AutoModelForCausalLM.from_pretrained(str(path), output_loading_info=True)
    except Exception as exc:
        if is_transient(exc):
            raise
        raise InvalidCheckpoint(path, f"model does not load: {exc!r}") from exc
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        if info.get(kind):
            raise InvalidCheckpoint(path, f"loading reports {kind}: {sorted(map(str, info[kind]))[:3]}")
    n_embeddings = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > n_embeddings:
        raise InvalidCheckpoint(path, f"tokenizer has {len(tokenizer)} tokens, the model {n_embeddings} embeddings")


# --- listing ----------------------------------------------------------------------------------


def _step_of(path: Path) -> int:
    return int(_CKPT_RE.match(path.name)[1])


def list_checkpoints(root) -> list[Path]:
    """``root/checkpoint-<int>`` dirs sorted by step (valid or not)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if _CKPT_RE.match(p.name) and p.is_dir()), key=_step_of)


def latest_valid_checkpoint(root, *, full: bool = False) -> Path | None:
    """The highest-step checkpoint that validates (structure only unless ``full``), or None."""
    for path in reversed(list_checkpoints(root)):
        if is_valid_checkpoint(path, full=full)[0]:
            return path
    return None


def surviving_checkpoints_message(root) -> str:
    """One line for failure messages, e.g. 'surviving valid checkpoints: checkpoint-20, checkpoint-40'."""
    try:
        names = [p.name for p in list_checkpoints(root) if is_valid_checkpoint(p, full=False)[0]]
    except OSError as exc:
        return f"could not list checkpoints in {root}: {exc}"
    if not names:
        return f"no valid checkpoint survives in {root}"
    return f"surviving valid checkpoints: {', '.join(names)}"
