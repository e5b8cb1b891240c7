"""Which opdkit modules one training step runs code in: a profile of a short CPU training on the embedded default.

    python bench/step_modules.py [-S loss.name=k1 ...]

Runs 2 steps (4 prompts x 2 samples, 40 new tokens) with ``sys.setprofile`` switched on only while one of the
step's phases runs: the functions the loop calls for the rollout, the teacher scoring, the loss and backward and
the update (``opdkit.step``'s ``draw`` / ``score_batch`` / ``loss_and_backward`` / ``update``; on a tree from
before ``opdkit/step.py``, ``opdkit.train``'s ``_draw`` / ``_losses`` / ``_update`` and ``opdkit.opd.score_batch``).
Prints, as JSON: every opdkit module a Python function of the step ran in, and the modules whose functions
call into another opdkit module (the step's flow, what a reader follows), each with its number of functions.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from opdkit.config import Config, replace  # noqa: E402

TINY = ("rollout.prompts_per_step=4", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=40",
        "budget.max_steps=2", "budget.max_wall_time_s=0", "optim.schedule=constant", "publish.every_steps=0",
        "runtime.threads=1")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-S", dest="overrides", action="append", default=[])
    args = p.parse_args()
    import opdkit.train as train

    try:
        from opdkit import step as phases_mod
        names = ("draw", "score_batch", "loss_and_backward", "update")
        owners = {n: phases_mod for n in names}
    except ImportError:  # before opdkit/step.py
        from opdkit import opd
        owners = {"_draw": train, "score_batch": opd, "_losses": train, "_update": train}
    funcs: dict[str, set] = defaultdict(set)  # module -> functions run
    calls_out: dict[str, set] = defaultdict(set)  # module -> functions that called into another opdkit module

    def profile(frame, event, arg):
        if event != "call":
            return
        mod = frame.f_globals.get("__name__", "")
        if not mod.startswith("opdkit"):
            return
        funcs[mod].add(frame.f_code.co_name)
        caller = frame.f_back
        cmod = caller.f_globals.get("__name__", "") if caller is not None else ""
        if cmod.startswith("opdkit") and cmod != mod:
            calls_out[cmod].add(caller.f_code.co_name)

    def traced(fn):
        def wrapper(*a, **k):
            prev = sys.getprofile()
            sys.setprofile(profile)
            try:
                return fn(*a, **k)
            finally:
                sys.setprofile(prev)
        return wrapper

    for name, mod in owners.items():
        setattr(mod, name, traced(getattr(mod, name)))
    cfg = replace(Config(), *TINY, *args.overrides)
    with tempfile.TemporaryDirectory() as d:
        train.train(cfg, Path(d) / "run", log=lambda *a: None, progress=False)
    print(json.dumps({
        "modules_run": {m: len(f) for m, f in sorted(funcs.items())},
        "n_modules_run": len(funcs),
        "flow_modules": {m: sorted(f) for m, f in sorted(calls_out.items())},
        "n_flow_modules": len(calls_out),
    }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
