"""opdkit.schedules at the boundaries, against hand-computed numbers."""

import pytest

from opdkit import schedules

approx = pytest.approx


def test_warmup_factor_edges():
    assert schedules.warmup_factor(0, 4) == 0.25  # (0 + 1) / 4
    assert schedules.warmup_factor(2, 4) == 0.75
    assert schedules.warmup_factor(3, 4) == 1.0  # reached at step warmup_steps - 1
    assert schedules.warmup_factor(100, 4) == 1.0
    assert schedules.warmup_factor(0, 1) == 1.0
    assert schedules.warmup_factor(0, 0) == 1.0  # no warmup
    assert schedules.warmup_factor(7, -1) == 1.0


def test_constant():
    assert schedules.constant(0, 0.1) == 0.1 and schedules.constant(10**6, 0.1) == 0.1


def test_linear():
    assert schedules.linear(0, 10, 1.0, 0.1) == 1.0
    assert schedules.linear(5, 10, 1.0, 0.1) == approx(0.55)  # 1 - 0.9 * 0.5
    assert schedules.linear(10, 10, 1.0, 0.1) == approx(0.1)
    assert schedules.linear(25, 10, 1.0, 0.1) == approx(0.1)


def test_cosine():
    assert schedules.cosine(0, 10, 1.0, 0.0) == 1.0
    assert schedules.cosine(5, 10, 1.0, 0.0) == approx(0.5)
    assert schedules.cosine(5, 10, 1.0, 0.1) == approx(0.55)
    assert schedules.cosine(10, 10, 1.0, 0.1) == approx(0.1)
    assert schedules.cosine(15, 10, 1.0, 0.1) == approx(0.1)
    # a quarter of the way: 0.5 * (1 + cos(pi / 4)) = 0.5 * 1.7071068
    assert schedules.cosine(25, 100, 1.0, 0.0) == approx(0.8535534)


def test_wallclock_cosine():
    lr, min_lr = 1e-6, 1e-7
    assert schedules.wallclock_cosine(0.0, 100.0, lr, min_lr) == approx(1e-6)
    assert schedules.wallclock_cosine(50.0, 100.0, lr, min_lr) == approx(5.5e-7)  # midpoint
    # a quarter of the budget: 1e-7 + 4.5e-7 * (1 + cos(pi / 4)) = 1e-7 + 4.5e-7 * 1.7071068
    assert schedules.wallclock_cosine(25.0, 100.0, lr, min_lr) == approx(8.681981e-7)
    assert schedules.wallclock_cosine(100.0, 100.0, lr, min_lr) == approx(1e-7)
    assert schedules.wallclock_cosine(250.0, 100.0, lr, min_lr) == approx(1e-7)


def _lr_at(schedule, **kw):
    args = dict(step=0, total_steps=10, elapsed_s=0.0, budget_s=100.0, lr=1.0, min_lr=0.0, warmup_steps=0)
    args.update(kw)
    return schedules.lr_at(schedule, **args)


def test_lr_at_dispatch_and_warmup():
    assert _lr_at("constant", step=3) == 1.0
    assert _lr_at("constant", step=0, warmup_steps=4) == 0.25
    assert _lr_at("linear", step=5) == approx(0.5)
    assert _lr_at("cosine", step=10) == approx(0.0)
    # warmup multiplies the decayed value: step 1 of 10, warmup 4 -> 0.5 * 0.5 * (1 + cos(0.1 pi))
    assert _lr_at("cosine", step=1, warmup_steps=4) == approx(0.5 * 0.9755283)
    assert _lr_at("cosine", step=5, warmup_steps=4) == approx(0.5)  # warmup over
    # wallclock ignores total_steps (0 is fine) but warms up by step
    assert _lr_at("wallclock_cosine", total_steps=0, elapsed_s=50.0) == approx(0.5)
    assert _lr_at("wallclock_cosine", total_steps=0, elapsed_s=50.0, step=1, warmup_steps=4) == approx(0.25)
    assert _lr_at("wallclock_cosine", elapsed_s=1e9, lr=1e-6, min_lr=1e-7) == approx(1e-7)
    assert _lr_at("constant", total_steps=0, budget_s=0.0) == 1.0  # constant needs no horizon


def test_lr_at_errors_say_what_to_set():
    with pytest.raises(ValueError, match="optim.schedule='bogus'"):
        _lr_at("bogus")
    for name in ("linear", "cosine"):
        with pytest.raises(ValueError, match="set budget.max_steps or budget.schedule_steps"):
            _lr_at(name, total_steps=0)
    with pytest.raises(ValueError, match="budget.max_wall_time_s"):
        _lr_at("wallclock_cosine", budget_s=0.0)


def test_wallclock_horizon_is_when_the_loop_stops():
    assert schedules.wallclock_horizon_s(100.0, 10.0, 0.0) == 90.0  # before the first step
    assert schedules.wallclock_horizon_s(100.0, 10.0, 4.0) == 86.0
    assert schedules.wallclock_horizon_s(100.0, 10.0, 95.0) == approx(1e-9)  # passed: min_lr
    assert schedules.wallclock_horizon_s(0.0, 10.0, 4.0) == 0.0  # no wall budget
    assert schedules.wallclock_horizon_s(100.0, 10.0, 4.0, save_s=20.0) == 66.0  # the final saves come first


def test_the_stop_rule_counts_the_next_step_and_the_final_saves():
    from opdkit.config import load_config

    cfg = load_config(None, ["budget.max_wall_time_s=100", "budget.deadline_reserve_s=10", "budget.max_steps=50"])
    # elapsed + next step + saves + reserve against the budget: 60 + 5 + 24 + 10 = 99 < 100 runs, 25 s of saves stops
    assert schedules.should_stop(3, 60.0, 5.0, 24.0, budget=cfg.budget) is None
    assert schedules.should_stop(3, 60.0, 5.0, 25.0, budget=cfg.budget) == "wall_clock"
    assert schedules.should_stop(50, 0.0, 0.0, 0.0, budget=cfg.budget) == "step_horizon"
    no_wall = load_config(None, ["budget.max_wall_time_s=0"]).budget
    assert schedules.should_stop(3, 1e9, 5.0, 1e9, budget=no_wall) is None


def test_wallclock_clock_starts_at_the_first_step():
    assert schedules.wallclock_clock(5.0, 5.0, 100.0, 10.0, 0.0) == (0.0, 85.0)
    assert schedules.wallclock_clock(50.0, 5.0, 100.0, 10.0, 2.0) == (45.0, 83.0)
    assert schedules.wallclock_clock(3.0, 0.0, 0.0, 10.0, 2.0) == (0.0, 0.0)  # no wall budget


def test_a_real_wall_clock_run_ends_at_min_lr(tmp_path):
    """``opdkit train`` with a 20 s budget and a 6 s reserve (start-up counted): the first step
    runs at lr, the last within a step's worth of min_lr. The bound: the last step began at the
    latest at max - reserve - 2 s (s: the longest step; the loop stops before a step that would
    end in the reserve), so its share of the schedule from the first step's start t0 to
    max - reserve is at least 1 - 2 s / (max - reserve - t0). Nothing here depends on the steps
    taking equal times (CI runs it beside other tests on 2 cores)."""
    import json
    import math
    import subprocess
    import sys

    from procs import env

    lr, min_lr = 1e-3, 1e-4
    for wall, reserve in ((20.0, 6.0), (60.0, 18.0)):  # the second only where start-up took the whole budget
        out = tmp_path / f"run{int(wall)}"
        cmd = [sys.executable, "-m", "opdkit", "train", "--out", str(out), "-p", "none", "--quiet",
               "-S", "optim.schedule=wallclock_cosine", "-S", f"budget.max_wall_time_s={wall}",
               "-S", f"budget.deadline_reserve_s={reserve}", "-S", "budget.max_steps=0", "-S", "optim.warmup_steps=0",
               "-S", f"optim.lr={lr}", "-S", f"optim.min_lr={min_lr}", "-S", "publish.every_steps=0",
               "-S", "rollout.prompts_per_step=2", "-S", "rollout.samples_per_prompt=2",
               "-S", "rollout.max_new_tokens=16", "-S", "loss.name=k1", "-S", "runtime.threads=1"]
        proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=150)
        assert proc.returncode == 0, proc.stderr[-2000:]
        rows = [json.loads(line) for line in (out / "metrics" / "train.jsonl").read_text().splitlines()]
        assert json.loads((out / "run.json").read_text())["reason"] == "wall_clock"
        if len(rows) >= 5:
            break
    assert len(rows) >= 5, rows
    step_s = max(r["time_rollout_s"] + r["time_score_s"] + r["time_update_s"] for r in rows) + 0.05
    t0 = rows[0]["elapsed_s"] - (rows[0]["time_rollout_s"] + rows[0]["time_score_s"] + rows[0]["time_update_s"])
    horizon = wall - reserve - t0
    assert rows[0]["lr"] == lr  # start-up does not eat into the schedule
    frac = max(0.0, 1.0 - 2.0 * step_s / horizon)
    bound = min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * frac))
    assert min_lr <= rows[-1]["lr"] <= bound, (rows[-1]["lr"], bound, step_s, len(rows))
    assert rows[-1]["lr"] - min_lr < 0.25 * (lr - min_lr)  # the old horizon (max_wall_time_s) stopped near 0.5
    # Decreasing over any span of at least one (longest) step: the schedule's end is the loop's stop
    # estimated with the last step's duration, so it moves by up to s between steps, and a step after
    # a slow one (a loaded machine) may run at a higher lr than that slow one. Over a span x_j - x_i >= s
    # it cannot rise: x_j / L >= x_i / (L - s) whenever x_j - x_i >= s * x_j / L, and x_j <= L
    # (x: seconds since the first step's start, L: max - reserve - t0).
    start = [r["elapsed_s"] - (r["time_rollout_s"] + r["time_score_s"] + r["time_update_s"]) for r in rows]
    pairs = [(a, b) for i, a in enumerate(rows) for j, b in enumerate(rows) if start[j] - start[i] >= step_s + 0.01]
    assert pairs and all(a["lr"] >= b["lr"] for a, b in pairs), [(a["step"], b["step"]) for a, b in pairs
                                                                  if a["lr"] < b["lr"]][:5]
