"""Writing model weights as safetensors: the export dtype, the shard plan, the files and the index.

Our own writer (plain Python I/O) rather than ``safetensors.torch.save_file``: a failing file
system then raises ``OSError`` with its errno, which the retry decision in ``opdkit.persist.fsutil``
needs. The shard plan and file names are huggingface_hub's (``split_torch_state_dict_into_shards``,
what ``save_pretrained`` uses), so a sharded export loads with ``from_pretrained`` as any other.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from opdkit.config import parse_size
from opdkit.persist.checkpoints import SAFETENSORS_DTYPES

EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export_dtype(setting: str, source_dir) -> torch.dtype:
    """``publish.dtype``: a dtype name, or ``auto`` = the dtype in the source model's config.json
    (``dtype`` or the older ``torch_dtype``; float32 when it names none). Bad values raise ``ValueError``."""
    if setting != "auto":
        if setting not in EXPORT_DTYPES:
            raise ValueError(f"publish.dtype: expected auto or one of {', '.join(EXPORT_DTYPES)}; got {setting!r}")
        return EXPORT_DTYPES[setting]
    config = json.loads((Path(source_dir) / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    if name not in EXPORT_DTYPES:
        raise ValueError(f"{source_dir}/config.json names dtype {name!r}; set publish.dtype to one of "
                         f"{', '.join(EXPORT_DTYPES)}")
    return EXPORT_DTYPES[name]


def shard_plan(tensors: dict[str, torch.Tensor], max_shard_size: str | int) -> dict[str, dict[str, torch.Tensor]]:
    """``{file name: tensors}``: one ``model.safetensors``, or ``model-0000i-of-0000n.safetensors``
    shards of at most ``max_shard_size`` each (a larger single tensor gets a shard of its own)."""
    from huggingface_hub import split_torch_state_dict_into_shards

    split = split_torch_state_dict_into_shards(tensors, max_shard_size=parse_size(max_shard_size))
    return {f: {k: tensors[k] for k in names} for f, names in split.filename_to_tensors.items()}


HASH_CHUNK = 64 << 20  # the chunk of ``chunked_sha256``
_MAX_WRITE = 1 << 30  # bytes per write(2) call (Linux caps one call at 2 GiB - 4 KiB)


def _sha256(views: list[memoryview]) -> bytes:
    h = hashlib.sha256()
    for v in views:
        h.update(v)  # releases the GIL on large buffers: chunks hash in parallel threads
    return h.digest()


def _hash_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=max(2, min(8, os.cpu_count() or 2)), thread_name_prefix="opdkit-weights")


def _tree(digests) -> str:
    return hashlib.sha256(b"".join(digests)).hexdigest()


def chunked_sha256(path: Path) -> str:
    """The ``chunked_sha256`` of a file: sha256 over the sha256 digests of its consecutive
    ``HASH_CHUNK``-byte chunks (the last one shorter), hashed in parallel threads."""
    size = os.path.getsize(path)
    with open(path, "rb") as f, _hash_pool() as pool:
        fd = f.fileno()
        futures = [pool.submit(lambda off: _sha256([memoryview(os.pread(fd, HASH_CHUNK, off))]), off)
                   for off in range(0, size, HASH_CHUNK)]
        return _tree(fu.result() for fu in futures)


def _write_chunk(fd: int, views: list[memoryview], pos: int) -> bytes:
    """Write ``views`` one after another at byte ``pos``; their sha256 (one chunk of ``chunked_sha256``)."""
    h = hashlib.sha256()
    for v in views:
        h.update(v)  # releases the GIL on large buffers, as pwrite does: chunks go in parallel
        while len(v):
            n = os.pwrite(fd, v[:_MAX_WRITE], pos)
            v, pos = v[n:], pos + n
    return h.digest()


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> dict:
    """Write the safetensors format with plain Python I/O, so that a failing file system raises
    ``OSError`` with its errno (the Rust writer reports ``SafetensorError`` without one, and the
    retry decision needs the errno). The bytes go from each tensor's own memory (no second copy of
    the model) in ``HASH_CHUNK`` pieces that parallel threads write at their positions and hash;
    returns the file's manifest record ``{"size", "chunked_sha256"}`` (no second read of the file)."""
    # Larger itemsize first keeps every tensor aligned to its itemsize (the header is 8-aligned).
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in order:
        t = tensors[name]
        if t.dtype not in SAFETENSORS_DTYPES:
            raise TypeError(f"tensor {name} has dtype {t.dtype}, which opdkit cannot save")
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]
        }  # fmt: skip
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    segments = [memoryview(struct.pack("<Q", len(header_bytes)) + header_bytes)]
    for name in order:
        flat_u8 = tensors[name].detach().contiguous().reshape(-1).view(torch.uint8)  # raw bytes
        if flat_u8.numel():
            segments.append(memoryview(flat_u8.numpy()).cast("B"))
    chunks, chunk, room = [], [], HASH_CHUNK  # the file cut into HASH_CHUNK pieces (each a list of views)
    for v in segments:
        while len(v):
            piece, v = v[:room], v[room:]
            chunk.append(piece)
            room -= len(piece)
            if not room:
                chunks.append(chunk)
                chunk, room = [], HASH_CHUNK
    if chunk:
        chunks.append(chunk)
    size = sum(len(v) for v in segments)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, size)
        with _hash_pool() as pool:
            futures = [pool.submit(_write_chunk, fd, c, i * HASH_CHUNK) for i, c in enumerate(chunks)]
            digest = _tree(fu.result() for fu in futures)
        os.fsync(fd)
    finally:
        os.close(fd)
    return {"size": size, "chunked_sha256": digest}


def write_index(path: Path, shards: dict[str, dict[str, torch.Tensor]]) -> None:
    """``model.safetensors.index.json`` for ``shards`` (``{file: tensors}``), as ``save_pretrained`` writes it."""
    total = sum(t.numel() * t.element_size() for ts in shards.values() for t in ts.values())
    index = {"metadata": {"total_size": total}, "weight_map": {k: f for f, ts in shards.items() for k in sorted(ts)}}
    path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
