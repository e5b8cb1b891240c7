"""Scale-out: ``torchrun`` ranks, FSDP2 sharding, and the few collectives the training loop needs.

``torchrun --nproc-per-node N -m opdkit train ...`` runs the same flat loop (``opdkit.train``) on
every rank. Per step:

- rank r rolls out, scores and back-propagates its share of the step's P prompts
  (``World.share``: prompts ``r*P/N .. (r+1)*P/N - 1``), with the per-sample seeds of their global
  sample indices, so the union of the ranks' samples is exactly a single-process run's;
- the step's token count is summed over ranks before the loss, and every rank divides its summed
  loss by ``global tokens / N``: FSDP averages gradients over the N ranks, so the update is the
  token mean over the whole step, as in one process;
- every rank issues the same collectives whatever its data: the loss's backward structure
  (``step.micro_losses``, with ``sharding.deferred_grad_sync`` / ``layers_gathered``) does not
  depend on a rank's completion lengths, and ``sharding.check_same_on_ranks`` refuses unequal
  numbers of micro-batches;
- metrics are reduced over ranks; rank 0 alone writes them and publishes checkpoints (the other
  ranks take part in gathering the full weights); every rank writes its shards of the trainer
  state (``opdkit.persist.trainer_state``).

The student is sharded with FSDP2 (``fully_shard`` on each decoder layer, then on the root, which
owns the embeddings, the final norm and the head). The teacher is replicated (inference only) or
sharded the same way (``runtime.teacher_sharding``). On CUDA the layers all-gather in bf16
(``MixedPrecisionPolicy``; the fp32 masters and the optimizer stay fp32). Rollouts: an engine with
its own copy of the weights (the static decoder, vLLM) gets them gathered one parameter at a time
in ``sync_weights``; the HF engine's decode loop on the live model runs under ``full_params`` (see
``engines.sharded``). Either way generation runs no collectives and a rank that finishes early does
not hold the others up.

The trainer state stores tensors by name at their global shapes (``torch.distributed.checkpoint``),
so a run resumes under any world size that divides ``rollout.prompts_per_step``, including one
process. Backend: NCCL on CUDA (``NCCL_NVLS_ENABLE=0`` unless set), gloo on CPU; a collective that
waits longer than ``runtime.collective_timeout_s`` for another rank raises (gloo; NCCL's watchdog
ends the process), and the loop turns it into ``CollectiveFailure`` naming the step and phase.

Nothing here runs or imports ``torch.distributed`` state on import; a plain ``python -m opdkit``
run never touches it (``World()`` is the single-process world).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from dataclasses import dataclass

import torch

from opdkit.config import Config, RuntimeConfig
from opdkit.engines import select
from opdkit.engines.weights import export_state_dict as _export
from opdkit.scoring import unwrap
from opdkit.setup import Run, RunError, make_optimizer
from opdkit.sharding import fsdp_units, full_params, is_sharded, reshard  # noqa: F401


def launched() -> bool:
    """True inside a process started by ``torchrun`` (it sets RANK, WORLD_SIZE, LOCAL_RANK ...)."""
    return all(v in os.environ for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


@dataclass(frozen=True)
class World:
    """This process's place among the ranks; ``World()`` is a plain single-process run."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")  # where collectives' tensors live
    active: bool = False  # a process group is up (launched by torchrun; then models are sharded)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def share(self, n: int) -> slice:
        """This rank's contiguous share of ``n`` items (``n`` must be a multiple of ``size``)."""
        if n % self.size:
            raise RunError(f"{n} items cannot be split evenly over {self.size} ranks")
        k = n // self.size
        return slice(self.rank * k, (self.rank + 1) * k)

    def sum(self, *xs: float) -> tuple[float, ...]:
        """Each of ``xs`` summed over ranks."""
        return self._reduce(xs, "sum")

    def max(self, *xs: float) -> tuple[float, ...]:
        """Each of ``xs``: its largest value over ranks."""
        return self._reduce(xs, "max")

    def broadcast(self, *xs: float) -> tuple[float, ...]:
        """Rank 0's values of ``xs`` on every rank (e.g. elapsed time: every rank must take the
        same stop decision and the same wall-clock learning rate)."""
        return self._reduce(xs, "broadcast")

    def gather(self, obj) -> list:
        """Every rank's ``obj`` (picklable), in rank order, on every rank."""
        if not self.active:
            return [obj]
        import torch.distributed as dist

        out: list = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def from_main(self, obj):
        """Rank 0's ``obj`` (picklable) on every rank: one decision for all (stop, resume, ...)."""
        if not self.active:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _reduce(self, xs, op: str) -> tuple[float, ...]:
        if not self.active:
            return tuple(float(x) for x in xs)
        import torch.distributed as dist

        t = torch.tensor([float(x) for x in xs], dtype=torch.float64, device=self.device)
        if op == "broadcast":
            dist.broadcast(t, src=0)
        else:
            dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return tuple(t.tolist())


_WORLD = World()


def init(rt: RuntimeConfig) -> World:
    """Join the process group when launched by torchrun (else the single-process ``World()``).

    CUDA (``runtime.device`` auto/cuda with a GPU): NCCL, one GPU per local rank. Otherwise gloo.
    Idempotent.
    """
    global _WORLD
    if _WORLD.active or not launched():
        return _WORLD
    import torch.distributed as dist

    rank, size, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    use_cuda = rt.device == "cuda" or (rt.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        if not torch.cuda.is_available():
            raise RunError("runtime.device=cuda but CUDA is not available on this node; use runtime.device=auto or cpu")
        if local >= torch.cuda.device_count():
            raise RunError(f"local rank {local} has no GPU (this node has {torch.cuda.device_count()}); "
                           "use --nproc-per-node <= the number of GPUs")
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink SHARP/multicast (not available everywhere)
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=datetime.timedelta(seconds=rt.collective_timeout_s),
                            **({"device_id": device} if use_cuda else {}))
    _WORLD = World(rank, size, local, device, active=True)
    return _WORLD


class CollectiveFailure(RuntimeError):
    """A collective of a torchrun rank timed out or lost its peer (a rank stuck, or dead) in one
    phase of a step; ``record`` names both for run.json."""

    def __init__(self, step: int, phase: str, cause: BaseException, timeout_s: float):
        self.step, self.phase = step, phase
        self.record = {"step": step, "collective_failure": phase}
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        where = "while starting" if phase == "startup" else f"in the {phase} phase of step {step}"
        super().__init__(f"a collective did not complete {where} ({first}): another rank stopped answering (it is "
                         f"stuck, or it died: see its own error). runtime.collective_timeout_s={timeout_s:g} bounds "
                         "the wait; raise it if one rank may legitimately wait longer for the others")


def is_collective_failure(exc: BaseException, world: World) -> bool:
    """True for the error of a collective that timed out or whose peer went away, on a rank of a
    process group: NCCL's ``DistError``s, and gloo's ``RuntimeError`` (its message names gloo)."""
    if not world.active or isinstance(exc, torch.OutOfMemoryError):
        return False
    import torch.distributed as dist

    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and "gloo" in str(exc))


def current() -> World:
    """The world ``init`` joined (``World()`` before, or without torchrun)."""
    return _WORLD


def shutdown() -> None:
    global _WORLD
    if _WORLD.active:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        _WORLD = World()


def check_params(cfg: Config, world: World) -> None:
    """What the world size requires of the params (raised before anything is written). Outside a
    process group the size is ``WORLD_SIZE`` if set: ``WORLD_SIZE=N opdkit train --check`` checks
    the params for a torchrun of N processes."""
    n = world.size if world.active else int(os.environ.get("WORLD_SIZE", "1"))
    select.check_params(cfg, world.device if world.active else torch.device(
        "cuda" if cfg.runtime.device != "cpu" and torch.cuda.is_available() else "cpu"))
    if cfg.runtime.collective_timeout_s <= 0:
        raise RunError(f"runtime.collective_timeout_s must be > 0 seconds, got {cfg.runtime.collective_timeout_s}")
    P = cfg.rollout.prompts_per_step
    if cfg.rollout.overlap and n > 1:
        raise RunError(f"rollout.overlap=1 runs in one process (a background rollout would interleave with the "
                       f"collectives of {n} ranks): set rollout.overlap=0 under torchrun")
    if P % n:
        raise RunError(f"rollout.prompts_per_step={P} must be a multiple of the number of ranks ({n}): "
                       "every rank rolls out the same number of prompts")


# --- sharding ---------------------------------------------------------------------------------


def shard_model(model, world: World):
    """FSDP2 in place: ``fully_shard`` each decoder layer, then the root (embeddings, final norm,
    head and everything else). Returns ``model``. On CUDA parameters are all-gathered in bf16
    (``MixedPrecisionPolicy(param_dtype=bfloat16)``, gradients reduced in fp32; the sharded fp32
    masters are what the optimizer steps).

    ``opdkit.opd`` calls the decoder and the head directly, not the root's ``forward`` (hidden
    states once, head logits chunk by chunk): ``register_fsdp_forward_method`` makes the root
    gather its parameters for those calls as it does for its own ``forward``.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(world.device.type, (world.size,))
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if world.device.type == "cuda" else MixedPrecisionPolicy())
    decoder, head = unwrap(model)
    for layer in decoder.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    in_root_forward = _count_root_forwards(model)
    for sub in (decoder, head):  # the submodules opd calls: each call gathers the root's parameters first
        _gather_root_for(model, sub, in_root_forward)
    # FSDP's lazy initialisation makes the module whose forward runs first the root: run one token
    # through the real root now (no grad, no RNG drawn), before anything calls a submodule.
    with torch.no_grad(), torch.random.fork_rng(devices=[world.device] if world.device.type == "cuda" else []):
        model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=world.device), use_cache=False)
    reshard(model)  # the root keeps its parameters gathered after a forward; parameters() must be the shards
    return model


def _count_root_forwards(root) -> list[int]:
    """A one-item list holding how many calls of the root's own ``forward`` are running (hooks on it)."""
    depth = [0]

    def enter(*_):
        depth[0] += 1

    def leave(*_):
        depth[0] -= 1

    root.register_forward_pre_hook(enter)
    root.register_forward_hook(leave, always_call=True)
    return depth


def _gather_root_for(root, sub, in_root_forward: list[int]) -> None:
    """Route ``sub.forward`` through the root FSDP module's pre/post-forward (gather, and reshard
    per the root's policy), as ``register_fsdp_forward_method`` does for a method of the root, when
    it is called on its own (``opdkit.opd``'s direct decoder and head calls). Inside the root's own
    ``forward`` (the HF engine's decode loop calls the model) the root is gathered already and
    ``sub`` runs as is: a nested pre/post-forward would leave the root's FSDP state idle, so the
    root's post-forward would reshard it (FSDP otherwise keeps the root gathered after a forward)
    and the next forward gather it again, one collective per decoded token even under
    ``full_params``, and ranks that decode different numbers of tokens would then mismatch."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    name = f"_opdkit_forward_{id(sub)}"
    inner = sub.forward
    setattr(root, name, lambda *a, **k: inner(*a, **k))
    register_fsdp_forward_method(root, name)
    hooked = getattr(root, name)
    sub.forward = lambda *a, **k: inner(*a, **k) if in_root_forward[0] else hooked(*a, **k)


def _broadcast_module(model, world: World) -> None:
    """Rank 0's parameters and buffers on every rank (e.g. a LoRA adapter initialised on each)."""
    import torch.distributed as dist

    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src=0)


def trainable_names(model) -> list[str]:
    """Names of the trainable parameters in optimizer order (``make_optimizer`` takes them in
    ``parameters()`` order); FSDP2 keeps the names."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def shard_run(run: Run, world: World) -> Run:
    """``run`` with its student (and teacher, per ``runtime.teacher_sharding``) sharded over the
    ranks and a new optimizer over the sharded parameters that carries the old one's state (a
    restored run's). Call after ``build_run`` and any restore, before the first step."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    cfg = run.cfg
    names = trainable_names(run.student)
    old = run.optimizer.state_dict()
    _broadcast_module(run.student, world)
    shard_model(run.student, world)
    if run.teacher is not run.student:
        if run.ema is not None:  # the EMA teacher is updated parameter by parameter from the student: same layout
            shard_model(run.teacher, world)
        elif cfg.runtime.teacher_sharding == "fsdp":
            shard_model(run.teacher, world)
    optimizer = make_optimizer(cfg, run.student, run.device)
    if old["state"]:
        by_name = {
            "state": {names[i]: s for i, s in old["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in old["param_groups"]],
        }
        set_optimizer_state_dict(run.student, optimizer, by_name, options=StateDictOptions(full_state_dict=True))
        for g, g_old in zip(optimizer.param_groups, old["param_groups"]):  # hyperparameters exactly as they were
            g.update({k: v for k, v in g_old.items() if k != "params"})
    return dataclasses.replace(run, optimizer=optimizer)


# --- optimisation -----------------------------------------------------------------------------


def clip_grad_norm_(params, max_norm: float) -> float:
    """``torch.nn.utils.clip_grad_norm_`` over the (possibly sharded) parameters; the global norm."""
    norm = torch.nn.utils.clip_grad_norm_(list(params), max_norm)
    full = getattr(norm, "full_tensor", None)  # a DTensor for sharded parameters
    return float(full() if full is not None else norm)


def reduce_metrics(m: dict, world: World) -> dict:
    """Combine ``step.micro_losses`` metrics over ranks: ``tokens`` summed, ``loss`` summed / size
    (each rank's loss is its token sum over ``global tokens / size``), ``*_max`` maxed, the rest
    token-weighted means."""
    if not world.active:
        return m
    parts = world.gather(m)
    total = sum(p.get("tokens", 0.0) for p in parts)
    out: dict = {"tokens": total, "loss": sum(p["loss"] for p in parts) / world.size}
    for key in {k for p in parts for k in p} - {"tokens", "loss"}:
        vals = [(p[key], p.get("tokens", 0.0)) for p in parts if p.get(key) is not None]
        if not vals:
            out[key] = None
        elif key.endswith("_max"):
            out[key] = max(v for v, _ in vals)
        elif all(isinstance(v, (int, float)) for v, _ in vals):
            w = sum(t for _, t in vals)
            out[key] = sum(v * t for v, t in vals) / w if w else sum(v for v, _ in vals) / len(vals)
        else:
            out[key] = vals[0][0]  # not a number (never produced today): rank 0's
    return out


# --- gathering the weights (rank 0 receives; every rank must call) -----------------------------


def gather_weights(model, **kw) -> dict[str, torch.Tensor]:
    """``engines.weights.export_state_dict`` (``kw``: its ``dtype``, ``copy``): plain weights named as the
    base model's, LoRA merged in, on rank 0's CPU ({} on other ranks; every rank takes part in
    gathering a sharded model)."""
    reshard(model)
    return _export(model, keep=current().is_main, **kw)


class NullPublisher:
    """The publisher of ranks other than 0: they gather weights with rank 0 but publish nothing."""

    def submit(self, step: int, **kwargs) -> None:
        pass

    def check(self) -> None:
        pass

    def wait(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass
