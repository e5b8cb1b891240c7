"""FSDP2 primitives the library needs below the training loop: is a model sharded, gather its
parameters for a block, put them back, and the two controls the loss's backward structure uses so
that every rank issues the same collectives whatever its data (``opdkit.step.micro_losses``).
Imports nothing from opdkit (``opdkit.distributed``, the engines and ``opdkit.setup`` build on it).

A sharded model here is the one ``distributed.shard_model`` builds: ``fully_shard`` on each
decoder layer, then on the root (``fsdp_units(model)[0]``), which owns the embeddings, the final
norm and the head. Every context manager below is a no-op on an unsharded model.
"""

from __future__ import annotations

import contextlib


def fsdp_units(model) -> list:
    """The FSDP2 modules of ``model``, the root first."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_sharded(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def layers_gathered(model):
    """Inside the block, each non-root unit (a decoder layer) of a sharded ``model`` is gathered
    when it is first used and stays gathered across forward and backward calls: decoder calls row
    by row (``runtime.unpadded_rows``) all-gather each layer once for all rows, and so does one
    backward through all of them (its gradients are still reduce-scattered, once per layer, as the
    backward completes). Every layer is sharded again on exit. Memory: the gathered layers, i.e.
    one unsharded copy of the decoder in the compute dtype, while the block runs."""
    units = fsdp_units(model)[1:]
    for u in units:
        u.set_reshard_after_forward(False, recurse=False)
        u.set_reshard_after_backward(False, recurse=False)
    try:
        yield model
    finally:
        for u in units:
            u.set_reshard_after_forward(True, recurse=False)
            u.set_reshard_after_backward(True, recurse=False)
            u.reshard()


@contextlib.contextmanager
def deferred_grad_sync(model):
    """Backward passes inside the block run no collectives on a sharded ``model``: no unit
    reduce-scatters its gradients or reshards its parameters, so each gradient accumulates,
    unsharded, where its parameters are gathered (a rank may run any number of such backwards, e.g.
    one per position chunk through the head, without pairing them with the other ranks'). The
    first backward after the block reduce-scatters the accumulated sums once and reshards, as
    usual; every rank must run it. Nor do these backwards end FSDP's backward bookkeeping
    (``set_is_last_backward(False)``), so that later backward still prefetches layer by layer."""
    if not is_sharded(model):
        yield model
        return
    model.set_requires_gradient_sync(False)
    model.set_reshard_after_backward(False)
    model.set_is_last_backward(False)
    try:
        yield model
    finally:
        model.set_requires_gradient_sync(True)
        model.set_reshard_after_backward(True)
        model.set_is_last_backward(True)


def check_same_on_ranks(model, n: int, what: str) -> None:
    """Raise ``RuntimeError`` on every rank unless every rank holding the sharded ``model`` passes
    the same ``n`` (e.g. its number of micro-batches: each one runs collectives, so unequal counts
    would leave a rank waiting forever). One small all-reduce; nothing for an unsharded model."""
    if not is_sharded(model):
        return
    import torch
    import torch.distributed as dist

    device = next(model.parameters()).device
    t = torch.tensor([n, -n], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    hi, lo = int(t[0]), -int(t[1])
    if hi != lo:
        raise RuntimeError(f"the ranks hold different numbers of {what} (from {lo} to {hi}; this rank {n}): each "
                           "runs collectives, so every rank must hold as many")


@contextlib.contextmanager
def full_params(model):
    """Inside the block every parameter of a sharded ``model`` is gathered (plain full tensors, as in
    an unsharded model) and forward passes run no collectives; sharded again on exit."""
    units = fsdp_units(model)
    if not units:
        yield model
        return
    with layers_gathered(model):  # the root keeps its parameters gathered after a forward anyway
        for u in units:
            u.unshard()
        try:
            yield model
        finally:
            units[0].reshard()


def reshard(model) -> None:
    """Back to the sharded layout (the root of a model that only ran forward keeps its parameters
    gathered until a backward; code that pairs parameters of two sharded models needs both sharded)."""
    for u in fsdp_units(model):
        u.reshard()
