"""Who else computes on the GPU: the compute processes on the device an evaluation is about to use.

The contract's evaluator refuses to start while a compute process still holds the GPU (a training
run that is still saving, a vLLM server, a notebook): the GPU workload lock (``fsutil.DeviceLock``)
covers opdkit's own runs only, so ``opdkit eval`` also asks the driver. ``compute_processes`` reads
NVML through ``pynvml`` where it is importable and the driver answers, else ``nvidia-smi
--query-compute-apps=pid,process_name,gpu_uuid --format=csv,noheader``; None when neither can tell
(no NVIDIA driver here: nothing to refuse). Only the GPU that ``cuda:0`` is in this process counts
(the first of ``CUDA_VISIBLE_DEVICES``, an index or a UUID), and this process itself never does. It
is asked before this process creates a CUDA context (so the driver does not list it, whatever the
PID namespace).

Standard library only (``pynvml`` imported when present).
"""

from __future__ import annotations

import os
import shutil
import subprocess

from opdkit.persist.fsutil import LockHeld


class GpuInUse(LockHeld):
    """Another compute process holds the GPU (exit status 75); the message names it."""

    def __init__(self, device: str, procs: list[tuple[int, str]]):
        self.directory, self.holder = device, ", ".join(f"pid {p} {n}" for p, n in procs)
        more = f" and {len(procs) - 1} more" if len(procs) > 1 else ""
        RuntimeError.__init__(self, f"{device} is in use by another compute process "
                                    f"(pid {procs[0][0]}: {procs[0][1]}{more}); an evaluation starts once it has "
                                    "exited (nvidia-smi lists it)")


def _visible_device() -> str | None:
    """``CUDA_VISIBLE_DEVICES``' first entry (an index or a GPU/MIG UUID), else None (index 0)."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return first or None


def _from_nvml(device: str | None) -> list[tuple[int, str]] | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver, or no NVML library: let nvidia-smi (or nothing) answer
        return None
    try:
        if device and not device.isdigit():
            handle = pynvml.nvmlDeviceGetHandleByUUID(device)
        else:
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(device or 0))
        out = []
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            try:
                name = pynvml.nvmlSystemGetProcessName(p.pid)
                name = name.decode() if isinstance(name, bytes) else name
            except Exception:  # a process in another PID namespace: its name is not ours to read
                name = "?"
            out.append((int(p.pid), name))
        return out
    except Exception:  # NVML answered nothing usable for this device
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # nothing to release
            pass


def _nvidia_smi(*query: str) -> list[list[str]] | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        proc = subprocess.run([exe, *query, "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    return [[c.strip() for c in ln.split(",")] for ln in proc.stdout.splitlines() if ln.strip()]


def _from_nvidia_smi(device: str | None) -> list[tuple[int, str]] | None:
    apps = _nvidia_smi("--query-compute-apps=pid,process_name,gpu_uuid")
    if apps is None:
        return None
    uuid = device if device and not device.isdigit() else None
    if uuid is None:
        gpus = _nvidia_smi("--query-gpu=index,uuid") or []
        uuid = next((g[1] for g in gpus if len(g) > 1 and g[0] == (device or "0")), None)
    out = []
    for row in apps:
        if not row or not row[0].isdigit():
            continue
        if uuid is not None and len(row) > 2 and row[2] and row[2] != uuid:
            continue  # another GPU's process
        out.append((int(row[0]), row[1] if len(row) > 1 else "?"))
    return out


def compute_processes() -> list[tuple[int, str]] | None:
    """(pid, name) of the compute processes on this process's ``cuda:0``, this process excluded; None
    when the driver cannot be asked."""
    device = _visible_device()
    procs = _from_nvml(device)
    if procs is None:
        procs = _from_nvidia_smi(device)
    if procs is None:
        return None
    return [(pid, name) for pid, name in procs if pid != os.getpid()]


def check_gpu_free() -> None:
    """Raise ``GpuInUse`` if another compute process holds this process's GPU."""
    procs = compute_processes()
    if procs:
        device = _visible_device()
        raise GpuInUse(f"GPU {device or 0}", procs)
