"""Tensors streamed into one file per writer at disk speed, and read back in place: the trainer state's storage.

``write_file(path, items)`` writes the raw bytes of each tensor (``items``: key, this writer's
tensor, its global shape, its offset in the global tensor) one after another, each at a 64-byte
aligned position, and returns the index entries that say where each lies. Nothing is serialised
(no pickling, no zip container, no checksum pass): the bytes go from the tensor's memory to the
file.

- A CPU tensor is written from its own memory (no copy).
- A GPU tensor passes through a few reused pinned host buffers (``STAGE_COUNT`` x ``STAGE_BYTES``,
  allocated at the first GPU save and kept): the copy into one buffer is queued on the current
  stream while the writer threads write the previous ones, so the device-to-host copies and the
  writes overlap and host memory never holds more than those buffers (no second copy of the
  weights or the optimizer state).
- ``WRITERS`` threads write ``STAGE_BYTES`` pieces at their positions at once (``pwrite``; the GIL
  is released while they write).
- The file is fsynced before ``write_file`` returns (``fsync=True``).

``view(path, entry)`` maps a written tensor back without reading it (``mmap``, copy-on-write);
``assemble`` copies the pieces of a tensor written by several writers (the shards of the ranks of a
sharded run) into a full tensor, so a state resumes under any number of ranks.

``_pwrite_all`` is the one place bytes reach the file system (tests patch it to inject I/O faults);
its ``OSError`` keeps its errno, for the retry decision (``opdkit.persist.fsutil``).
"""

from __future__ import annotations

import math
import mmap
import os
import queue
import threading
from collections.abc import Iterable
from pathlib import Path

import torch

ALIGN = 64
STAGE_BYTES = 64 << 20  # one write, and one staging buffer
STAGE_COUNT = 8
WRITERS = 4  # threads writing at once (one thread's copies into the page cache cap a single stream near 1-4 GB/s)
_MAX_WRITE = 1 << 30  # bytes per write(2) call (Linux caps one call at 2 GiB - 4 KiB)
_stages: list[torch.Tensor] = []  # pinned staging buffers, reused by every GPU save of this process
_maps: dict[str, mmap.mmap] = {}

DTYPES = {str(dt).removeprefix("torch."): dt for dt in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)}


def _pwrite_all(fd: int, data: memoryview, pos: int) -> None:
    """Write all of ``data`` at byte ``pos`` of the file (threads write disjoint ranges at once)."""
    while len(data):
        n = os.pwrite(fd, data[:_MAX_WRITE], pos)
        data, pos = data[n:], pos + n


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements as a flat uint8 tensor on its device (a copy only if ``t`` is not contiguous)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _pinned_stages() -> list[torch.Tensor]:
    if not _stages:
        _stages.extend(torch.empty(STAGE_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(STAGE_COUNT))
    return _stages


class _Writers:
    """``WRITERS`` threads that write queued pieces (at most ``STAGE_BYTES`` each) at their positions,
    in parallel; a GPU piece first waits for its copy's event, then its staging buffer goes back to
    ``free``. The first error stops the writing (later pieces are dropped, their buffers still
    returned) and is raised by ``close``."""

    def __init__(self, fd: int):
        self.fd, self.error = fd, None
        self.work: queue.Queue = queue.Queue(maxsize=4 * WRITERS)  # CPU pieces are views: a short queue suffices
        self.free: queue.Queue = queue.Queue()  # staging buffers not in use (filled at the first GPU piece)
        self.staged = False
        self.threads = [threading.Thread(target=self._run, name=f"opdkit-state-writer-{i}", daemon=True)
                        for i in range(WRITERS)]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        while True:
            item = self.work.get()
            if item is None:
                return
            data, n, pos, event, stage = item
            try:
                if event is not None:
                    event.synchronize()
                if self.error is None:
                    view = memoryview(data[:n].numpy()).cast("B") if isinstance(data, torch.Tensor) else data[:n]
                    _pwrite_all(self.fd, view, pos)
            except BaseException as e:  # raised in the caller's thread by close()
                self.error = e
            finally:
                if stage is not None:
                    self.free.put(stage)

    def put_cpu(self, src_u8: torch.Tensor, pos: int) -> None:
        view = memoryview(src_u8.numpy()).cast("B")
        for off in range(0, len(view), STAGE_BYTES):
            piece = view[off:off + STAGE_BYTES]
            self.work.put((piece, len(piece), pos + off, None, None))

    def put_gpu(self, src_u8: torch.Tensor, pos: int) -> None:
        """Stream the GPU bytes ``src_u8`` through the staging buffers."""
        if not self.staged:
            for stage in _pinned_stages():
                self.free.put(stage)
            self.staged = True
        for off in range(0, src_u8.numel(), STAGE_BYTES):
            if self.error is not None:
                return
            stage = self.free.get()
            n = min(STAGE_BYTES, src_u8.numel() - off)
            stage[:n].copy_(src_u8[off:off + n], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self.work.put((stage, n, pos + off, event, stage))

    def close(self) -> None:
        for _ in self.threads:
            self.work.put(None)
        for t in self.threads:
            t.join()
        if self.error is not None:
            raise self.error


def write_file(path: str | os.PathLike, items: Iterable[tuple[list, torch.Tensor, list[int], list[int]]], *,
               fsync: bool = True) -> tuple[list[dict], int]:
    """Write ``items`` (key, tensor, global shape, global offset) into a new file at ``path``; return
    (index entries, bytes written). An entry: ``key``, ``dtype``, ``shape`` (this piece's),
    ``global_shape``, ``offset`` (in the global tensor), ``pos`` and ``nbytes`` (in the file)."""
    entries, pos = [], 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        writers = _Writers(fd)
        try:
            for key, t, global_shape, offset in items:
                if t.dtype not in DTYPES.values():
                    raise TypeError(f"tensor {key} has dtype {t.dtype}, which opdkit cannot save")
                pos += -pos % ALIGN  # the gap stays a hole: it reads as zeros
                nbytes = t.numel() * t.element_size()
                entries.append({"key": key, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                                "global_shape": list(global_shape), "offset": list(offset), "pos": pos,
                                "nbytes": nbytes})
                if nbytes:
                    src = _bytes_of(t)
                    (writers.put_gpu if src.device.type == "cuda" else writers.put_cpu)(src, pos)
                pos += nbytes
                if writers.error is not None:
                    break
        finally:
            writers.close()
        os.ftruncate(fd, pos)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    return entries, pos


def view(path: str | os.PathLike, entry: dict) -> torch.Tensor:
    """The tensor ``entry`` describes, mapped from ``path`` (read lazily; copy-on-write, the file is
    never changed)."""
    key = str(path)
    mm = _maps.get(key)
    if mm is None:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
        _maps[key] = mm
    end = entry["pos"] + entry["nbytes"]
    if entry["nbytes"] and (mm is None or len(mm) < end):
        raise ValueError(f"{path} ends at byte {0 if mm is None else len(mm)}, before tensor {entry['key']} (bytes "
                         f"{entry['pos']}..{end}): the file is truncated")
    dtype = DTYPES[entry["dtype"]]
    if not entry["nbytes"]:
        return torch.empty(entry["shape"], dtype=dtype)
    flat = torch.frombuffer(mm, dtype=torch.uint8, count=entry["nbytes"], offset=entry["pos"])
    return flat.view(dtype).reshape(entry["shape"])


def release(paths: Iterable[str | os.PathLike]) -> None:
    """Forget the maps of ``paths`` (they close once no tensor viewing them is left)."""
    for p in paths:
        _maps.pop(str(p), None)


def assemble(dst: torch.Tensor, pieces: list[tuple[Path, dict]], what: str) -> None:
    """Copy the written pieces of one tensor into ``dst`` (its full, global shape): every element
    must be covered once. Raises ``ValueError`` naming ``what`` otherwise."""
    shapes = {tuple(e["global_shape"]) for _, e in pieces}
    if shapes != {tuple(dst.shape)}:
        raise ValueError(f"{what}: saved with shape {sorted(shapes)}, expected {list(dst.shape)}")
    covered = sum(math.prod(e["shape"]) for _, e in pieces)
    if covered != dst.numel():
        raise ValueError(f"{what}: the saved pieces hold {covered} of its {dst.numel()} elements "
                         "(a rank's file missing?)")
    for path, e in pieces:
        region = tuple(slice(o, o + s) for o, s in zip(e["offset"], e["shape"]))
        dst[region].copy_(view(path, e))
