"""One-step-off rollouts (``rollout.overlap: 1``): the next step's batch is drawn while this step
scores and updates.

Step n of a run (θ_k: the weights after k updates)::

    take the batch of step n     the first step of a start: drawn now, by θ_{n-1} (lag 0);
                                 later: drawn during step n-1, by θ_{n-2} (lag 1), waited for if not ready
    prefetch the batch of n+1    a background thread draws it with the engine's weights, θ_{n-1}
    score and update             θ_{n-1} -> θ_n, while the prefetch runs
    sync_weights(θ_n)            waits for the prefetch to finish, then pushes θ_n into the engine

From the second step on, each batch was drawn by the weights one update behind those it trains
(``rollout_lag`` 1 in train.jsonl). The token losses (k1, k2, k3) reweight each token with the
log-probs the engine recorded while drawing it (``Rollout.sampling_logp_B_T``, the losses'
``old_logp_B_T``: k1's clipped PPO ratio, k2 / k3's importance weight), as they already do for the
sampler's own rounding. That corrects the last token's distribution only: the prefix stays the one
the old weights drew, exactly as the full-vocabulary losses (rkl, fkl, jsd, topk_fkl) take it (exact
at each sampled prefix, the prefixes one update old, as one-step-off trainers do). So the update is
biased, and by how much is stated, measured by exact enumeration (``opdkit.biases.OVERLAP_BIAS``):
k2's bias is rkl's and k3's fkl's to the last digit, k1's PPO clip adds to it, and with top-p < 1 the
sampled-token losses miss the ids inside the current nucleus that the stale one excluded
(``UNREACHABLE_BIAS``). A correction (sequence-level importance weights for the prefix)
would weight every position of every loss by a product of ratios over its prefix, whose variance grows
with the completion's length; opdkit does not make it. The reward term is refused with overlap
(``rewards.check_params``). With weights that do not change (lr = 0) the run is the on-policy run,
step for step (tests/test_overlap.py).

What can overlap on one GPU: a rollout's decode steps are latency-bound (small kernels, and
vLLM's scheduling and output processing on the CPU between them), so the GPU has idle time during
a rollout that the update's large kernels can fill. The prefetch runs on a CUDA stream of its own
(vLLM's model runner is pointed at it, ``VLLMEngine.bind_stream``), its rollout is handed over
through the CPU (no tensor crosses streams), and the Python switch interval is shortened while it
runs: both threads share the GIL (torch releases it inside each op; Python between ops holds it).
The gain is at most the scoring + update time, in practice less; bench/s1_speed.sh measures it.
On a CPU both threads compete for the same cores: the results are the same, not faster.

The engine holds its own copy of the weights (vLLM, the static decoder, or ``HFEngine(own_copy=
True)``): the live weights change while it draws. vLLM stays awake while the update runs: its
weights + KV cache and the training state must fit on the GPU together.

Resume: the prefetched batch is part of the trainer state (``state`` / ``restore``: saving
waits for it), so a run killed or stopped by a signal resumes exactly as if uninterrupted (the
alignment check, which compares log-probs recomputed by the current weights with the sampler's,
is skipped on a lagged first batch). No prefetch is started for a step the loop will not run
(``budget.max_steps``, or the wall clock at the pace of the last step), so a finished run
extended to more steps draws its first new batch on-policy. One process only (under torchrun a
background rollout would interleave with the ranks' collectives).
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time

import torch

from opdkit.engines.base import Rollout

SWITCH_INTERVAL_S = 2e-4  # while a prefetch runs: a thread waiting for the GIL gets it within 0.2 ms (Python: 5 ms)


def _key(prompts, kw: dict) -> tuple:
    """What identifies a rollout request (not whether it records log-probs)."""
    return (tuple(map(tuple, prompts)), tuple(kw["seeds"]), kw["samples_per_prompt"], kw["temperature"], kw["top_p"],
            kw["max_new_tokens"])


def to_device(rollout: Rollout, device) -> Rollout:
    return Rollout(*(None if t is None else t.to(device) for t in dataclasses.astuple(rollout)))


class Lookahead:
    """An engine wrapper that draws the next step's batch in the background (module docstring).

    ``sample`` returns the prefetched batch when it was prefetched with the same arguments (and
    sets ``lag`` = 1), else draws now (``lag`` = 0); ``prefetch`` starts the next one;
    ``sync_weights`` waits for a running prefetch before pushing. ``waited_s`` accumulates the
    seconds the caller spent waiting for a prefetch (the loop books them as rollout time)."""

    reads_live_model = False

    def __init__(self, engine, autocast, device: torch.device):
        if engine.reads_live_model:
            raise ValueError("rollout.overlap=1 needs an engine with its own copy of the weights (it draws while the "
                             "live weights are updated)")
        self.engine, self.autocast, self.device = engine, autocast, device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        if self.stream is not None and hasattr(engine, "bind_stream"):
            engine.bind_stream(self.stream)
        self.model = None  # the model of the last push
        self.pushed = False  # pushed since the engine last drew (a vLLM engine sleeps its weights away after drawing)
        self.lag, self.waited_s = 0, 0.0
        self._job: dict | None = None  # key, thread, rollout (on the CPU) or error

    def sync_weights(self, model) -> None:
        self.wait()
        self.engine.sync_weights(model)
        self.model, self.pushed = model, True

    def sample(self, prompts, **kw) -> Rollout:
        job = self._job
        if job is not None:
            self._join(job)  # within the caller's rollout time: not added to waited_s
            if job["key"] != _key(prompts, kw):
                raise RuntimeError("rollout.overlap: the prefetched batch was drawn for other prompts or seeds than "
                                   "this step's (a bug: the loop and its prefetch disagree)")
            self._job = None
            if "error" in job:
                raise job["error"]
            self.lag = 1
            return to_device(job["rollout"], self.device)
        self.lag = 0
        rollout = to_device(to_device(self._draw(prompts, kw), "cpu"), self.device)  # through the CPU, as a prefetch
        self.pushed = False
        return rollout

    def prefetch(self, prompts, **kw) -> None:
        """Start drawing ``prompts`` (``sample``'s arguments) with the weights of the last push."""
        if self._job is not None:
            raise RuntimeError("rollout.overlap: a prefetch is already pending")
        if not self.pushed:  # the engine drew since the last push (vLLM then dropped its weights): push them again
            self.engine.sync_weights(self.model)
        self.pushed = False
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the pushed weights are written
        job: dict = {"key": _key(prompts, kw), "switch": sys.getswitchinterval()}

        def work():
            try:
                job["rollout"] = to_device(self._draw(prompts, kw), "cpu")  # handed over through the CPU
            except BaseException as e:  # re-raised in the caller's thread by sample()
                job["error"] = e

        sys.setswitchinterval(SWITCH_INTERVAL_S)
        job["thread"] = threading.Thread(target=work, name="opdkit-prefetch", daemon=True)
        self._job = job
        job["thread"].start()

    def _draw(self, prompts, kw) -> Rollout:
        if self.stream is None:
            with self.autocast():
                return self.engine.sample(prompts, **kw)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream), self.autocast():
            rollout = self.engine.sample(prompts, **kw)
            self.stream.synchronize()
            return rollout

    def wait(self) -> None:
        """Block until a running prefetch has finished (its result is kept for ``sample``); the
        seconds spent waiting are added to ``waited_s``."""
        if self._job is not None:
            t0 = time.perf_counter()
            self._join(self._job)
            self.waited_s += time.perf_counter() - t0

    @staticmethod
    def _join(job: dict) -> None:
        if "done" not in job:
            job["thread"].join()
            job["done"] = True
            sys.setswitchinterval(job["switch"])

    def pop_waited(self) -> float:
        w, self.waited_s = self.waited_s, 0.0
        return w

    def state(self) -> dict | None:
        """The prefetched batch (finished, on the CPU) for the trainer state; None if there is none."""
        self.wait()
        job = self._job
        if job is None:
            return None
        if "error" in job:
            raise job["error"]
        return {"key": job["key"], "rollout": dataclasses.asdict(job["rollout"])}

    def restore(self, saved: dict | None) -> None:
        """Take ``state``'s prefetched batch as this start's first (``sample`` hands it over, lag 1)."""
        if saved is None:
            return
        self._job = {"key": saved["key"], "rollout": Rollout(**saved["rollout"]), "done": True}
