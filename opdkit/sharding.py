"""FSDP2 primitives the library needs below the training loop: is a model sharded, gather its
parameters for a block, put them back. Imports nothing from opdkit (``opdkit.distributed``, the
engines and ``opdkit.setup`` build on it)."""

from __future__ import annotations

import contextlib


def fsdp_units(model) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def is_sharded(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def full_params(model):
    """Inside the block every parameter of a sharded ``model`` is gathered (plain full tensors, as in
    an unsharded model) and forward passes run no collectives; sharded again on exit."""
    units = fsdp_units(model)
    if not units:
        yield model
        return
    units[0].set_reshard_after_forward(False)  # recursive: no unit frees its parameters after forward
    for u in units:
        u.unshard()
    try:
        yield model
    finally:
        for u in units[1:]:  # the root keeps FSDP's root setting (False); the layers go back to True
            u.set_reshard_after_forward(True, recurse=False)
        for u in units:
            u.reshard()


def reshard(model) -> None:
    """Back to the sharded layout (the root of a model that only ran forward keeps its parameters
    gathered until a backward; code that pairs parameters of two sharded models needs both sharded)."""
    for u in fsdp_units(model):
        u.reshard()
