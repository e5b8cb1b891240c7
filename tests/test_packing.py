"""runtime.unpadded_rows as one packed forward (opdkit.packing) against each row run alone
(scoring.completion_hidden's row-by-row path), on the CPU (the attention function's per-row
fallback: the packing, positions, row boundaries and the scatter back are what is checked here; the
varlen FlashAttention itself in tests/test_gpu.py)."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from opdkit import packing
from opdkit.engines.base import left_pad
from opdkit.models import hf_checkpointing
from opdkit.scoring import build_geometry, completion_hidden


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_packed_hidden_states_and_gradients_equal_row_by_row(arch, tok):
    kw = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**kw, head_dim=8)) if arch == "qwen3" else Qwen2ForCausalLM(Qwen2Config(**kw))
    hf_checkpointing(model, True)  # the keywords that carry the row boundaries pass through it
    model.train()
    prompts = [tok(p).input_ids for p in ["Compute 47+5-29.", "Compute 3+4.", "Compute 88-80+17-5."]]
    pid, pmask = left_pad(prompts, tok.pad_token_id)
    comp = torch.randint(5, 30, (3, 9))
    cmask = torch.ones(3, 9)
    cmask[1, 4:] = 0
    cmask[2, 1:] = 0
    geo = build_geometry(pid, pmask, comp, cmask)
    weight_H = torch.linspace(-1, 1, 32)
    got = {}
    for name, fn in (("rows", lambda: completion_hidden(model, geo, unpadded=True)),
                     ("packed", lambda: packing.packed_hidden(model.model, geo.input_ids_B_S, geo.attention_mask_B_S,
                                                              geo.prompt_width, geo.completion_len))):
        model.zero_grad()
        h = fn()
        (h * weight_H).sum().backward()
        got[name] = (h.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    (h_rows, g_rows), (h_packed, g_packed) = got["rows"], got["packed"]
    assert h_packed.shape == h_rows.shape == (3, 9, 32)
    assert torch.allclose(h_packed, h_rows, atol=1e-5) and h_rows.abs().max() > 0.1
    assert (h_packed[2, 1:] == 0).all() and (h_packed[1, 4:] == 0).all()  # past a row's completion: zeros
    assert g_rows.keys() == g_packed.keys() and len(g_rows) > 10
    for n in g_rows:
        assert torch.allclose(g_packed[n], g_rows[n], rtol=1e-4, atol=1e-5), n
    # a forward without row boundaries (a padded batch) still attends as sdpa, with its mask
    batched = model.model(input_ids=geo.input_ids_B_S, attention_mask=geo.attention_mask_B_S,
                          position_ids=geo.position_ids_B_S).last_hidden_state
    model.config._attn_implementation = "sdpa"
    want = model.model(input_ids=geo.input_ids_B_S, attention_mask=geo.attention_mask_B_S,
                       position_ids=geo.position_ids_B_S).last_hidden_state
    assert torch.allclose(batched, want, atol=1e-6)


def test_a_completion_with_a_gap_is_refused(tok):
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    pid, pmask = left_pad([tok("Compute 3+4.").input_ids], tok.pad_token_id)
    cmask = torch.tensor([[1.0, 0.0, 1.0]])
    geo = build_geometry(pid, pmask, torch.tensor([[5, 6, 7]]), cmask)
    with pytest.raises(ValueError, match="gap"):
        packing.packed_hidden(model.model, geo.input_ids_B_S, geo.attention_mask_B_S, geo.prompt_width, 3)


def _packed_grads(model, geo, keep_attention: bool, seen: list) -> dict:
    """Gradients of a packed forward / backward of ``model`` under gradient checkpointing, keeping the attention
    outputs or not (models.enable_checkpointing); ``seen`` collects the ops the policy was asked to save."""
    from opdkit import models

    def recording(ctx, op, *args, **kwargs):
        decision = models.keep_attention_policy(ctx, op, *args, **kwargs)
        if str(decision).endswith("MUST_SAVE"):
            seen.append(str(op))
        return decision

    hf_checkpointing(model, False)
    original = models.keep_attention_policy
    models.keep_attention_policy = recording
    try:
        models.enable_checkpointing(model, keep_attention)
    finally:
        models.keep_attention_policy = original
    model.zero_grad()
    h = packing.packed_hidden(model.model, geo.input_ids_B_S, geo.attention_mask_B_S, geo.prompt_width,
                              geo.completion_len)
    (h * torch.linspace(-1, 1, h.shape[-1], device=h.device)).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _two_rows(tok, layers: int):
    """A small random Qwen2 in training mode (seed 0) and the geometry of two prompts with 7 completion tokens."""
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                         pad_token_id=tok.pad_token_id))
    model.train()
    prompts = [tok(p).input_ids for p in ["Compute 47+5-29.", "Compute 3+4."]]
    pid, pmask = left_pad(prompts, tok.pad_token_id)
    return model, build_geometry(pid, pmask, torch.randint(5, 30, (2, 7)), torch.ones(2, 7))


def test_keeping_the_attention_outputs_under_checkpointing_gives_the_same_gradients(tok):
    """runtime.checkpoint_keep_attention: each layer's attention output is saved by the forward and not recomputed
    (torch's selective activation checkpointing), the gradients bit for bit those of full recomputation."""
    model, geo = _two_rows(tok, layers=2)
    seen_full, seen_kept = [], []
    full = _packed_grads(model, geo, False, seen_full)
    kept = _packed_grads(model, geo, True, seen_kept)
    assert seen_full == [] and len(seen_kept) >= 2 * 2  # each row's attention in each layer: saved, not recomputed
    assert full.keys() == kept.keys() and len(full) > 10
    for n in full:
        assert torch.equal(full[n], kept[n]), n


def test_layers_left_unchecked_give_the_same_gradients_and_are_not_recomputed(tok, monkeypatch):
    """runtime.unchecked_layers_memory (models.checkpoint_all_but_last): the last layers run without checkpointing
    (their MLP runs once, not again in the backward), the gradients bit for bit those of checkpointing every layer,
    with and without the attention outputs kept."""
    from opdkit import models

    model, geo = _two_rows(tok, layers=3)
    calls = [0, 0, 0]
    mlps = [layer.mlp for layer in model.model.layers]
    mlp_forward = type(mlps[0]).forward

    def counted(self, x):  # (module hooks do not fire in a checkpoint's recompute; the forward itself runs)
        calls[mlps.index(self)] += 1
        return mlp_forward(self, x)

    monkeypatch.setattr(type(mlps[0]), "forward", counted)
    for keep_attention in (False, True):
        grads = []
        for n in (0, 1, 3):
            calls[:] = [0, 0, 0]
            hf_checkpointing(model, False)
            models.enable_checkpointing(model, keep_attention)
            models.checkpoint_all_but_last(model.model.layers, n)
            model.zero_grad()
            h = packing.packed_hidden(model.model, geo.input_ids_B_S, geo.attention_mask_B_S, geo.prompt_width, 7)
            (h * torch.linspace(-1, 1, h.shape[-1])).sum().backward()
            grads.append({k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
            assert calls == [1 if i >= 3 - n else 2 for i in range(3)], (n, calls)  # a recompute: a second call
        assert len(grads[0]) > 10
        for other in grads[1:]:
            assert other.keys() == grads[0].keys()
            for k in grads[0]:
                assert torch.equal(grads[0][k], other[k]), k


@pytest.mark.parametrize("autocast,keep_attention", [(False, True), (True, True), (True, False)])
def test_layers_keeping_their_matmuls_give_the_same_gradients_and_recompute_no_matmul(tok, autocast, keep_attention):
    """runtime.checkpoint_keep_matmuls (models.checkpoint_all_but_last's layers that keep their matmuls): the
    backward's recompute of such a layer runs none of its projections' matrix products (they come from what the
    forward saved), and the gradients are bit for bit those of recomputing every layer and of leaving every layer
    unchecked, in fp32 and under bf16 autocast over fp32 weights, whether the other layers keep their attention
    outputs (runtime.checkpoint_keep_attention) or not."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from opdkit import models

    class CountMatmuls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += str(func).rsplit(".", 1)[0] in models.MATMUL_OPS
            return func(*args, **(kwargs or {}))

    model, geo = _two_rows(tok, layers=3)
    layers = model.model.layers
    results = {}
    for plan in [(0, 0), (0, 3), (1, 1), (3, 0)]:  # (unchecked, keeping their matmuls)
        hf_checkpointing(model, False)
        models.enable_checkpointing(model, keep_attention=keep_attention)
        models.checkpoint_all_but_last(layers, *plan)
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            h = packing.packed_hidden(model.model, geo.input_ids_B_S, geo.attention_mask_B_S, geo.prompt_width, 7)
        counter = CountMatmuls()
        with counter:
            (h.float() * torch.linspace(-1, 1, h.shape[-1])).sum().backward()
        results[plan] = counter.n, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    n_full, g_full = results[(0, 0)]
    recompute = {plan: n - results[(3, 0)][0] for plan, (n, _) in results.items()}
    # a recompute stops once the backward's inputs are back: six of a layer's seven products (not down's output)
    assert recompute == {(0, 0): 3 * 6, (0, 3): 0, (1, 1): 1 * 6, (3, 0): 0}, recompute  # (1, 1): layer 0 recomputes
    assert len(g_full) > 10
    for plan, (_, g) in results.items():
        assert g.keys() == g_full.keys()
        for k in g_full:
            assert torch.equal(g_full[k], g[k]), (plan, k)
