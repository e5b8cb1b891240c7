"""An engine over an FSDP2-sharded policy: full weights gathered only where the engine reads them.

An engine that samples the live model (``reads_live_model``: the HF engine's ``decode``) runs its whole
``sample`` under ``full_params``; an engine with a copy of its own (the static decoder, vLLM)
gathers nothing to sample, and its ``sync_weights`` reads ``merged_weights``, which gathers one
parameter at a time. Every rank calls both at the same points of the loop (gathering is
collective).
"""

from __future__ import annotations

import contextlib

from opdkit.sharding import full_params, is_sharded


class ShardedEngine:
    def __init__(self, inner, model):
        self.inner, self.model = inner, model
        self.reads_live_model = inner.reads_live_model

    def sample(self, prompts, **kw):
        with full_params(self.model) if self.reads_live_model else contextlib.nullcontext():
            return self.inner.sample(prompts, **kw)

    def sync_weights(self, model) -> None:
        self.model = model
        self.inner.sync_weights(model)


def wrap_engine(engine, model):
    """``engine`` as is for an unsharded ``model`` (or if already wrapped); a ``ShardedEngine`` around it otherwise."""
    if isinstance(engine, ShardedEngine) or not is_sharded(model):
        return engine
    return ShardedEngine(engine, model)
