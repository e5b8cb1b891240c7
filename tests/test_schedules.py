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
