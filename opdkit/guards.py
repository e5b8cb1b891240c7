"""Faults a training step can hit, turned into errors that say what happened and what to change.

- ``nonfinite_values`` / ``check_parameters``: a non-finite loss or gradient norm is caught before
  the optimizer steps; parameters are checked (one inf-norm reduction) after it. Either raises
  ``NonFiniteError`` (or, for loss/gradient under ``runtime.on_nonfinite: skip``, lets the loop
  drop the update).
- ``StepProgress`` + ``out_of_memory``: the loop records which phase of which step runs; a CUDA
  out-of-memory error becomes ``OutOfMemory`` naming that phase and the knobs that lower memory.

Nothing here saves or deletes anything: the caller leaves the last good trainer state and
checkpoints as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# The params that lower the memory of each phase (all wired to real behaviour in opdkit).
MEMORY_KNOBS = {
    "rollout": ("rollout.batch_size (sequences per decode call)", "rollout.max_new_tokens",
                "rollout.gpu_memory_utilization (vLLM: the share of the GPU it reserves)"),
    "score": ("runtime.logprob_chunk (positions per log-softmax chunk)", "optim.micro_batch",
              "runtime.teacher_sharding=fsdp (torchrun)"),
    "update": ("optim.micro_batch (sequences per forward/backward)", "runtime.grad_checkpointing=true",
               "runtime.logprob_chunk"),
}


class NonFiniteError(RuntimeError):
    """A loss, gradient norm or parameter went non-finite at ``step``; nothing of it was saved."""

    def __init__(self, step: int, names: list[str], detail: str):
        self.step, self.names = step, list(names)
        self.record = {"step": step, "nonfinite": self.names}  # for run.json
        super().__init__(f"non-finite {', '.join(self.names)} at step {step} ({detail})")


class OutOfMemory(RuntimeError):
    """The device ran out of memory in one phase of a step (the message names the knobs)."""

    def __init__(self, step: int, phase: str, cause: BaseException):
        self.step, self.phase = step, phase
        self.record = {"step": step, "out_of_memory": phase}
        knobs = MEMORY_KNOBS.get(phase, ())
        advice = f"; lower the memory with {', '.join(knobs)}" if knobs else ""
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        where = "while loading the models" if phase == "startup" else f"in the {phase} phase of step {step}"
        super().__init__(f"out of memory {where} ({first}){advice}")


@dataclass
class StepProgress:
    """Where the loop is: the step being computed (1-based) and its phase."""

    step: int = 0
    phase: str = "startup"


def out_of_memory(exc: BaseException, progress: StepProgress) -> OutOfMemory:
    return OutOfMemory(progress.step, progress.phase, exc)


def nonfinite_values(**values: float) -> list[str]:
    """The names of the values that are NaN or infinite (``None`` counts as absent)."""
    return [k for k, v in values.items() if v is not None and not math.isfinite(float(v))]


def parameters_finite(params: list[torch.Tensor]) -> bool:
    """True if every element of ``params`` is finite: one max-abs reduction per tensor (no copy of
    the model), global over ranks for FSDP-sharded parameters. All ranks must call it."""
    if not params:
        return True
    norm = torch.nn.utils.get_total_norm(params, norm_type=float("inf"), foreach=None)
    full = getattr(norm, "full_tensor", None)  # a DTensor for sharded parameters
    return math.isfinite(float(full() if full is not None else norm))


def check_parameters(params: list[torch.Tensor], step: int) -> None:
    if not parameters_finite(params):
        raise NonFiniteError(step, ["parameters"], "the optimizer step made some weights NaN or infinite, "
                             "although the loss and gradient norm were finite; lower optim.lr")


def stop_or_skip(names: list[str], values: dict, step: int, skips: int, on_nonfinite: str, max_skips: int) -> None:
    """Raise ``NonFiniteError`` unless the policy lets this step's update be dropped (``skips``:
    consecutive non-finite steps including this one)."""
    shown = ", ".join(f"{k}={v}" for k, v in values.items())
    if on_nonfinite == "stop":
        raise NonFiniteError(step, names, f"{shown}; the update was not applied and nothing was saved. Lower "
                             "optim.lr or set optim.grad_clip, or set runtime.on_nonfinite=skip to drop such steps")
    if skips > max_skips:
        raise NonFiniteError(step, names, f"{shown}; {skips} steps in a row were non-finite (runtime."
                             f"max_nonfinite_skips={max_skips}); nothing of them was saved. Lower optim.lr or set "
                             "optim.grad_clip")
