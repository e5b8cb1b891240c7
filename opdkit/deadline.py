"""The end of a run inside its wall budget: what the loop reserves for the saves it will make, and when
a step in flight must be given up.

``budget.max_wall_time_s`` is when the last checkpoint must be complete, start-up included. Before
each step the loop (``opdkit.train``) asks ``schedules.should_stop`` whether the next step, then the
final saves (the trainer state and the HF export of that step), then ``budget.deadline_reserve_s``
still fit; the saves' seconds are ``SaveClock.reserve``:

- measured: the longest state save and the longest export (snapshot to files in place) of this
  start so far (a periodic one ran while training went on: an upper bound of a final one);
- before the first of each kind: its bytes (``state_bytes``, ``export_bytes``) over the write rate
  measured at start-up (``probe_write_rate``: ``budget.write_probe_mb`` MiB written, fsynced and
  removed in the directories the saves go to), times ``budget.save_estimate_factor``.

A step in flight is given up (``interrupt.check_abandon``, between decode steps) when its rollout
runs past ``rollout_deadline_s``: the point where the saves must start, less what the step still has
to do after its rollout (the last step's scoring and update; nothing known before the first step).
``SaveClock.record`` keeps every save's bytes and seconds, and ``decision`` what the stop reserved
and why, for run.json and the log.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

KINDS = ("state", "export")
LAUNCH_ENV = "OPDKIT_LAUNCHED_AT"  # run.sh: the epoch seconds it started at (the wall budget counts from there)


def started_at() -> float:
    """The ``time.monotonic()`` the run started at, start-up included: ``$OPDKIT_LAUNCHED_AT`` (epoch
    seconds; run.sh sets it as it starts, so its pre-flight and torchrun's start count too), else this
    process's start (Linux ``/proc``: the interpreter and its imports count), else now."""
    now_mono, now_wall = time.monotonic(), time.time()
    launched = os.environ.get(LAUNCH_ENV)
    if launched:
        try:
            age = now_wall - float(launched)
            if 0 <= age < 7 * 86400:
                return now_mono - age
        except ValueError:
            pass
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        age = uptime - ticks / os.sysconf("SC_CLK_TCK")
        if 0 <= age < 7 * 86400:
            return now_mono - age
    except (OSError, ValueError, IndexError):
        pass
    return now_mono


def probe_write_rate(directories: list[Path], nbytes: int) -> float:
    """Bytes per second of writing ``nbytes`` (in 8 MiB writes, then fsync) into each of ``directories``
    that lies on a file system of its own; the slowest. The probe file is removed; 0 for ``nbytes`` 0."""
    if nbytes <= 0:
        return 0.0
    seen, rates = set(), []
    block = memoryview(os.urandom(1 << 20) * 8)
    for d in directories:
        d.mkdir(parents=True, exist_ok=True)
        dev = os.stat(d).st_dev
        if dev in seen:
            continue
        seen.add(dev)
        path = d / f".opdkit-write-probe-{os.getpid()}"
        t0 = time.monotonic()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                left = nbytes
                while left > 0:
                    left -= os.write(fd, block[:min(left, len(block))])
                os.fsync(fd)
            finally:
                os.close(fd)
        finally:
            path.unlink(missing_ok=True)
        rates.append(nbytes / max(time.monotonic() - t0, 1e-6))
    return min(rates)


def state_bytes(model: torch.nn.Module, ema: torch.nn.Module | None = None, optimizer_slots: int = 2) -> int:
    """About the bytes of a trainer state: the trainable parameters with ``optimizer_slots`` tensors of
    their size each (AdamW: 2), plus an EMA teacher's parameters."""
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    ema_bytes = sum(p.numel() * p.element_size() for p in ema.parameters()) if ema else 0
    return trainable * (1 + optimizer_slots) + ema_bytes


def export_bytes(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """About the bytes of an HF export of ``model`` in ``dtype`` (tied weights once, LoRA adapters merged)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    size = torch.empty((), dtype=dtype).element_size()
    return sum(p.numel() for n, p in base.named_parameters() if "lora_" not in n) * size


def rollout_deadline_s(max_wall_time_s: float, deadline_reserve_s: float, save_s: float, after_rollout_s: float,
                       elapsed_s: float) -> float | None:
    """Seconds from now (``elapsed_s`` into the budget) by which the rollout in flight must end so that
    the rest of its step (``after_rollout_s``: the last step's scoring and update) and the saves
    (``save_s``) end ``deadline_reserve_s`` before ``max_wall_time_s``; None without a wall budget."""
    if max_wall_time_s <= 0:
        return None
    return max_wall_time_s - deadline_reserve_s - save_s - after_rollout_s - elapsed_s


class SaveClock:
    """The seconds the saves take: measured, or estimated until they are (module docstring)."""

    def __init__(self, state_bytes: int, export_bytes: int, rate_bps: float, factor: float):
        self.bytes = {"state": state_bytes, "export": export_bytes}
        self.rate_bps, self.factor = rate_bps, factor
        self.measured: dict[str, list[float]] = {k: [] for k in KINDS}
        self.saves: list[dict] = []  # every save of this start: what, step, bytes, seconds, GB/s

    def record(self, what: str, step: int, nbytes: int, seconds: float) -> dict:
        entry = {"what": what, "step": step, "gb": round(nbytes / 1e9, 3), "s": round(seconds, 3),
                 "gb_per_s": round(nbytes / 1e9 / max(seconds, 1e-9), 3)}
        self.measured[what].append(seconds)
        self.saves.append(entry)
        return entry

    def expected(self, what: str) -> tuple[float, str]:
        """(seconds, how they were had) of the next save of kind ``what``."""
        if self.measured[what]:
            return max(self.measured[what]), "measured"
        if self.rate_bps <= 0:
            return 0.0, "not estimated (budget.write_probe_mb=0)"
        return (self.bytes[what] / self.rate_bps * self.factor,
                f"estimated: {self.bytes[what] / 1e9:.2f} GB at the probe's {self.rate_bps / 1e9:.2f} GB/s "
                f"x {self.factor:g}")

    def reserve(self) -> tuple[float, dict]:
        """(seconds, parts): the final state save and export."""
        parts = {}
        for what in KINDS:
            s, how = self.expected(what)
            parts[what] = {"s": round(s, 3), "basis": how}
        return sum(p["s"] for p in parts.values()), parts


def decision(reason: str, step: int, elapsed_s: float, next_step_s: float, save_s: float, parts: dict,
             max_wall_time_s: float, deadline_reserve_s: float, abandoned: bool) -> dict:
    """What run.json records about the stop: why, when, and what the rule reserved."""
    return {"reason": reason, "step": step, "at_s": round(elapsed_s, 3), "abandoned_step": abandoned,
            "budget_s": max_wall_time_s, "next_step_s": round(next_step_s, 3), "saves_s": round(save_s, 3),
            "saves": parts, "deadline_reserve_s": deadline_reserve_s,
            "reserved_s": round(next_step_s + save_s + deadline_reserve_s, 3)}
