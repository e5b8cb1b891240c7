"""What a checkpoint is, and how to tell a complete one from one that only looks complete.

A checkpoint is an ordinary HF directory ``ROOT/checkpoint-<step>/`` (config.json,
model.safetensors, tokenizer files, generation_config.json) plus ``opdkit.json`` (the exporter's
``meta`` + step, format and every file's size and sha256). ``opdkit.persist.publish`` writes them; this
module validates and lists them (for the exporter itself, retention, resume, ``opdkit validate``
and failure messages).

Why validation looks inside the weights: a 12-hour run once left checkpoint directories whose
weights had been pruned yet looked valid. So the presence of the expected files is not the test.
``validate_checkpoint`` accepts a directory only if, in this order:

- config.json parses as an HF config;
- ``opdkit.json``, where present, has our format and every file it lists has the recorded size
  (and, with ``check_hashes``, the recorded sha256: of the whole file, or for the weights the
  ``chunked_sha256`` their writer computed, ``opdkit.persist.weights_io``);
- the weights (``model.safetensors``, or an index and every shard it names) have intact
  safetensors headers, each tensor's byte count fits its dtype and shape, and each file is exactly
  as long as its header says (not truncated); with an index, every shard holds exactly the tensors
  the index maps to it, and no tensor is stored twice;
- tokenizer_config.json and one vocabulary file are present;
- every tensor the config's architecture expects is in the weights with the right shape (tied
  copies and the model class's ignorable keys excepted), and no tensor it does not know is there.

These checks read only headers (the expected tensors come from a model skeleton on the meta
device), so stubs and pruned weights are caught without loading the model. With ``full=True``
every floating-point value is then streamed from the files (a bounded buffer, never the whole
model) and must be finite (the reason names the tensor), and the tokenizer and model are loaded
with ``Auto*`` and must report no missing, unexpected or mismatched keys. An I/O error that may be
transient is raised as ``OSError`` (we cannot tell whether the checkpoint is bad), not as
``InvalidCheckpoint``; ``is_valid_checkpoint`` never
raises and gives the reason instead.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from opdkit.persist.fsutil import is_transient, list_checkpoints

FORMAT = 1
MANIFEST = "opdkit.json"
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
TOKENIZER_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}  # fmt: skip
_ST_ITEMSIZE = {name: torch.empty((), dtype=dt).element_size() for dt, name in SAFETENSORS_DTYPES.items()}


class NonFiniteTensor(ValueError):
    """A weight tensor holds NaN or infinite values (``name`` says which)."""

    def __init__(self, name: str, message: str):
        self.name = name
        super().__init__(message)


_FLOAT_CODES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_CHUNK_BYTES = 64 * 2**20


def all_finite(t: torch.Tensor, chunk: int = 1 << 24) -> bool:
    """No NaN/inf in the floating tensor ``t``, ``chunk`` elements at a time: a chunk whose sum is
    finite holds no NaN or inf (either makes the sum non-finite); only a chunk whose sum is not
    finite (a NaN or inf, or an overflow of finite values) is checked element by element. The sum
    runs at memory speed where ``isfinite`` on bf16 does not (about 50x slower on a CPU)."""
    flat = t.detach().reshape(-1)
    for i in range(0, flat.numel(), chunk):
        part = flat[i:i + chunk]
        if not bool(torch.isfinite(part.sum())) and not bool(torch.isfinite(part).all()):
            return False
    return True


def nonfinite_names(tensors: dict[str, torch.Tensor], threads: int = 8) -> list[str]:
    """The floating tensors of ``tensors`` that hold NaN or inf (``all_finite``), checked by parallel
    threads (torch releases the GIL inside each sum)."""
    from concurrent.futures import ThreadPoolExecutor

    names = [k for k, t in tensors.items() if t.is_floating_point()]
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        ok = list(pool.map(lambda k: all_finite(tensors[k]), names))
    return [k for k, good in zip(names, ok) if not good]


class InvalidCheckpoint(ValueError):
    def __init__(self, path: Path | str, reason: str):
        self.path, self.reason = Path(path), reason
        super().__init__(f"{path}: {reason}")


# --- validation -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    shapes: dict[str, tuple[int, ...]]  # every tensor the model's state_dict holds
    tied: dict[str, str]  # tied target -> source; a target may be absent from the weights
    ignore_missing: tuple[str, ...]  # regexes from the model class
    ignore_unexpected: tuple[str, ...]


_spec_cache: dict[str, ModelSpec] = {}
_spec_lock = threading.Lock()


_SHAPE_IRRELEVANT_KEYS = {"architectures", "transformers_version", "dtype", "torch_dtype", "_name_or_path"}


def model_spec(config) -> ModelSpec:
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
    spec = ModelSpec(
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
            _validate_values(path)
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


def check_weight_files(path) -> None:
    """Raise ``InvalidCheckpoint`` unless the safetensors weights of model directory ``path`` (one file, or
    an index and every shard it names) have intact headers and are exactly as long as those say. Headers
    only, so cheap at any size: what a model directory from elsewhere (a student or teacher) gets before
    it is trusted, where ``validate_checkpoint`` would also want opdkit's manifest and tokenizer files."""
    path = Path(path)
    _read_weight_shapes(path, lambda reason: InvalidCheckpoint(path, reason))


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
        spec = model_spec(config)
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
        if check_hashes and not _hash_matches(file, record):
            raise bad(f"{name} does not match the sha256 recorded in {MANIFEST}")


def _hash_matches(file: Path, record: dict) -> bool:
    if "chunked_sha256" in record:  # the weights, hashed while they were written (opdkit.persist.weights_io)
        from opdkit.persist.weights_io import chunked_sha256

        return chunked_sha256(file) == record["chunked_sha256"]
    return file_record(file)["sha256"] == record["sha256"]


def file_record(path: Path) -> dict[str, Any]:
    """A file's entry in ``opdkit.json``: its size and sha256."""
    with open(path, "rb") as f:
        sha256 = hashlib.file_digest(f, "sha256").hexdigest()
    return {"size": path.stat().st_size, "sha256": sha256}


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
            in_shard = _read_safetensors_header(path / shard, bad)
            for name in in_shard:
                if name in shapes:
                    raise bad(f"tensor {name} is stored twice (again in {shard})")
                if weight_map.get(name) != shard:
                    raise bad(f"{shard} holds tensor {name}, which {WEIGHTS_INDEX} maps to "
                              f"{weight_map.get(name) or 'no shard'}")
            shapes.update(in_shard)
        for name, shard in weight_map.items():
            if name not in shapes:
                raise bad(f"tensor {name} is mapped to {shard} in {WEIGHTS_INDEX} but not stored there")
        return shapes
    if (path / WEIGHTS).is_file():
        return _read_safetensors_header(path / WEIGHTS, bad)
    raise bad(f"no model weights ({WEIGHTS} or {WEIGHTS_INDEX})")


def _weight_files(path: Path) -> list[Path]:
    if (path / WEIGHTS_INDEX).is_file():
        return [path / f for f in sorted(set(json.loads((path / WEIGHTS_INDEX).read_text())["weight_map"].values()))]
    return [path / WEIGHTS]


def _validate_values(path: Path) -> None:
    """Every floating-point value in the weight files is finite; streamed in ``_CHUNK_BYTES``
    reads (after ``_validate_structure``, so the headers are known to be sound)."""
    buf = bytearray(_CHUNK_BYTES)
    for file in _weight_files(path):
        with open(file, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
            header.pop("__metadata__", None)
            for name, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
                dtype = _FLOAT_CODES.get(entry["dtype"])
                if dtype is None:
                    continue
                begin, end = entry["data_offsets"]
                f.seek(8 + header_len + begin)
                left = end - begin
                while left:
                    n = f.readinto(memoryview(buf)[:min(left, len(buf))])
                    if not n:
                        raise InvalidCheckpoint(path, f"{file.name} ends inside tensor {name}")
                    values = torch.frombuffer(buf, dtype=dtype, count=n // dtype.itemsize)
                    if not bool(torch.isfinite(values).all()):
                        raise InvalidCheckpoint(path, f"tensor {name} in {file.name} has NaN or infinite values")
                    left -= n


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


# --- listing (step_of, list_checkpoints: opdkit.persist.fsutil, torch-free) ---------------------------


def surviving_checkpoints_message(root) -> str:
    """One line for failure messages, e.g. 'surviving valid checkpoints: checkpoint-20, checkpoint-40'."""
    try:
        names = [p.name for p in list_checkpoints(root) if is_valid_checkpoint(p, full=False)[0]]
    except OSError as exc:
        return f"could not list checkpoints in {root}: {exc}"
    if not names:
        return f"no valid checkpoint survives in {root}"
    return f"surviving valid checkpoints: {', '.join(names)}"
