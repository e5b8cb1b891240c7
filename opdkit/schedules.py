"""Learning-rate schedules: pure functions of the optimizer step (0-based) or elapsed wall time.

- ``constant``: lr throughout.
- ``linear``: lr at step 0 down to min_lr at step >= total_steps.
- ``cosine``: half-cosine from lr at step 0 to min_lr at step >= total_steps.
- ``wallclock_cosine``: the same half-cosine over wall time, from the run's first step to when
  the training loop stops (``wallclock_clock``, ``wallclock_horizon_s``: the budget less the
  reserve, the final saves and one step), so the last step runs at min_lr up to one step's worth.

``lr_at`` dispatches by name and multiplies by the linear warmup factor
``min(1, (step + 1) / warmup_steps)``; the decay runs from step 0 (it does not wait for warmup).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from opdkit.config import BudgetConfig

SCHEDULES = ("constant", "linear", "cosine", "wallclock_cosine")


def warmup_factor(step: int, warmup_steps: int) -> float:
    """``min(1, (step + 1) / warmup_steps)``: 1 / warmup_steps at step 0, 1 from step warmup_steps - 1.

    1 throughout when ``warmup_steps <= 0``.
    """
    assert step >= 0, f"step must be >= 0, got {step}"
    if warmup_steps <= 0:
        return 1.0
    return min(1.0, (step + 1) / warmup_steps)


def _cosine_at(frac: float, lr: float, min_lr: float) -> float:
    """Half-cosine from lr (frac 0) to min_lr (frac >= 1)."""
    frac = min(max(frac, 0.0), 1.0)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * frac))


def constant(step: int, lr: float) -> float:
    """``lr`` at every step."""
    return float(lr)


def linear(step: int, total_steps: int, lr: float, min_lr: float) -> float:
    """Linear from ``lr`` at step 0 to ``min_lr`` at step >= total_steps."""
    assert total_steps > 0, f"total_steps must be > 0, got {total_steps}"
    frac = min(max(step / total_steps, 0.0), 1.0)
    return lr + (min_lr - lr) * frac


def cosine(step: int, total_steps: int, lr: float, min_lr: float) -> float:
    """Half-cosine from ``lr`` at step 0 to ``min_lr`` at step >= total_steps."""
    assert total_steps > 0, f"total_steps must be > 0, got {total_steps}"
    return _cosine_at(step / total_steps, lr, min_lr)


def wallclock_horizon_s(max_wall_time_s: float, deadline_reserve_s: float, step_s: float, save_s: float = 0.0) -> float:
    """Elapsed seconds at which the wall-clock cosine should reach min_lr: when the loop stops.

    The loop (``opdkit.train``) starts no step that would end, with the final saves after it
    (``save_s``: ``opdkit.deadline``), within ``deadline_reserve_s`` of ``max_wall_time_s``, with
    ``step_s`` (the last step's duration) as the estimate of the next: so no step starts after
    ``max - reserve - save_s - step_s``. ``elapsed`` and this horizon both count start-up (loading
    models and data), as the wall budget does. 0 without a wall budget; a horizon already passed is
    clamped to 1e-9 s (min_lr).
    """
    if max_wall_time_s <= 0:
        return 0.0
    return max(max_wall_time_s - deadline_reserve_s - save_s - step_s, 1e-9)


def wallclock_clock(elapsed_s: float, start_s: float, max_wall_time_s: float, deadline_reserve_s: float,
                    step_s: float, save_s: float = 0.0) -> tuple[float, float]:
    """(seconds into the wall-clock schedule, its length) for ``wallclock_cosine``.

    The schedule starts at ``start_s``, the elapsed time of the run's first step (start-up, which
    the wall budget counts, is not training), and ends at ``wallclock_horizon_s``. (0, 0)
    without a wall budget.
    """
    if max_wall_time_s <= 0:
        return 0.0, 0.0
    end_s = wallclock_horizon_s(max_wall_time_s, deadline_reserve_s, step_s, save_s)
    return max(elapsed_s - start_s, 0.0), max(end_s - start_s, 1e-9)


def wallclock_cosine(elapsed_s: float, budget_s: float, lr: float, min_lr: float) -> float:
    """Half-cosine from ``lr`` at 0 s to ``min_lr`` at elapsed_s >= budget_s (share of the wall budget)."""
    assert budget_s > 0, f"budget_s must be > 0, got {budget_s}"
    return _cosine_at(elapsed_s / budget_s, lr, min_lr)


def lr_at(
    schedule: str,
    *,
    step: int,
    total_steps: int,
    elapsed_s: float,
    budget_s: float,
    lr: float,
    min_lr: float,
    warmup_steps: int,
) -> float:
    """The learning rate at ``step`` / ``elapsed_s`` for the named schedule, times the warmup factor.

    ``total_steps`` is used by linear/cosine, ``elapsed_s``/``budget_s`` by wallclock_cosine; the
    others are ignored. Raises ValueError on an unknown schedule or a missing horizon.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"optim.schedule={schedule!r}: expected one of {SCHEDULES}")
    if schedule in ("linear", "cosine") and total_steps <= 0:
        raise ValueError(
            f"optim.schedule={schedule!r} needs a step horizon but total_steps={total_steps}: "
            "set budget.max_steps or budget.schedule_steps"
        )
    if schedule == "wallclock_cosine" and budget_s <= 0:
        raise ValueError(
            f"optim.schedule='wallclock_cosine' needs a wall budget but budget_s={budget_s}: "
            "set budget.max_wall_time_s > 0"
        )
    if schedule == "constant":
        base = constant(step, lr)
    elif schedule == "linear":
        base = linear(step, total_steps, lr, min_lr)
    elif schedule == "cosine":
        base = cosine(step, total_steps, lr, min_lr)
    else:
        base = wallclock_cosine(elapsed_s, budget_s, lr, min_lr)
    return base * warmup_factor(step, warmup_steps)


def should_stop(step: int, elapsed: float, last_step_s: float, save_s: float = 0.0, *,
                budget: BudgetConfig) -> str | None:
    """Why the loop stops before step ``step + 1``: the step horizon (``budget.max_steps``), or the
    wall budget (``budget.max_wall_time_s``: the next step, as long as the last one, then the final
    saves, ``save_s``, would end within ``budget.deadline_reserve_s`` of it); else None."""
    b = budget
    if b.max_steps and step >= b.max_steps:
        return "step_horizon"
    if b.max_wall_time_s and elapsed + last_step_s + save_s + b.deadline_reserve_s >= b.max_wall_time_s:
        return "wall_clock"
    return None
