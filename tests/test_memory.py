"""The memory estimate (``opdkit.memory``) against measurements: parameter counts against the
loaded models (and peft's own LoRA wrapping), weights / gradients / AdamW moments against the
tensors a real optimizer step allocates, and activations against the bytes autograd actually
saves in a forward pass (``saved_tensors_hooks``), on the embedded Llama student and the
real-scale fixture's Qwen2 student (grouped key-value heads, q/k/v biases)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from opdkit.config import load_config
from opdkit.embedded import asset
from opdkit.memory import GRADIENTS, activation_bytes_per_token, estimate, model_shape
from opdkit.models import load_model
from opdkit.scoring import unwrap
from qwen2_fixture import fixture_dir


@pytest.fixture(scope="module")
def students(tmp_path_factory) -> dict[str, Path]:
    return {"embedded": asset("student"), "fixture": fixture_dir(tmp_path_factory) / "student"}


def saved_activation_bytes(model, ids_B_S: torch.Tensor) -> int:
    """Bytes of the distinct tensors autograd saves for backward in a forward of the decoder
    (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        unwrap(model)[0](input_ids=ids_B_S, use_cache=False)
    return sum(saved.values())


@pytest.mark.parametrize("which", ["embedded", "fixture"])
def test_model_shape_counts_the_loaded_models_parameters(which, students):
    model = load_model(students[which], torch.device("cpu"), trainable=True)
    s = model_shape(students[which])
    assert s.params == s.trainable == sum(p.numel() for p in model.parameters())
    assert s.rows == model.get_output_embeddings().weight.shape[0]
    lora = load_config(None, ["lora.enabled=true", "lora.r=4"]).lora
    from peft import LoraConfig, get_peft_model

    wrapped = get_peft_model(model, LoraConfig(r=4, lora_alpha=lora.alpha, target_modules=list(lora.target_modules),
                                               task_type="CAUSAL_LM"))
    s = model_shape(students[which], lora)
    assert (s.params, s.trainable) == (sum(p.numel() for p in wrapped.parameters()),
                                       sum(p.numel() for p in wrapped.parameters() if p.requires_grad))
    from opdkit.memory import shape_of

    assert shape_of(wrapped) == s  # the loaded model's shape (step.uncheck_layers reads it), LoRA-wrapped too


@pytest.mark.parametrize("which", ["embedded", "fixture"])
def test_activation_estimate_is_within_10_percent_of_what_autograd_saves(which, students):
    torch.manual_seed(0)
    model = load_model(students[which], torch.device("cpu"), trainable=True).train()
    B, S = 2, 96
    ids_B_S = torch.randint(0, 30, (B, S))
    measured = saved_activation_bytes(model, ids_B_S)
    est = B * S * activation_bytes_per_token(model_shape(students[which]), 4, checkpointing=False)
    assert 0.9 < est / measured < 1.1, (est, measured)


def test_held_weights_gradients_and_adam_moments_are_the_bytes_a_real_step_allocates(students):
    cfg = load_config(None, ["teacher.source=privileged_live"])
    model = load_model(students["embedded"], torch.device("cpu"), trainable=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = model(input_ids=torch.randint(0, 30, (2, 16)), labels=torch.randint(0, 30, (2, 16)))
    out.loss.backward()
    opt.step()
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    moments = [v for st in opt.state.values() for k, v in st.items() if k in ("exp_avg", "exp_avg_sq")]
    parts = estimate(cfg, model_shape(students["embedded"]), None, 10, torch.device("cpu"), "hf", 2**34)
    want = {"student fp32 weights": nbytes(model.parameters()), "AdamW moments (fp32)": nbytes(moments)}
    assert parts["held"] == want
    assert parts["update"][GRADIENTS] == nbytes(p.grad for p in model.parameters())


def test_keeping_the_attention_outputs_adds_what_an_h200_measured():
    """runtime.checkpoint_keep_attention at S1's shape: S1 at 7,168 new tokens (57,344 completion + ~1,200 prompt
    tokens in one packed micro-batch) peaked 4.6 GB higher with it on an H200 (BENCHMARKS.md, 2026-12-03)."""
    from opdkit.memory import ModelShape

    s1 = ModelShape(params=1_777_088_000, trainable=1_777_088_000, layers=28, hidden=1536, kv=256, intermediate=8960,
                    rows=151_936)
    extra = 58_500 * (activation_bytes_per_token(s1, 2, True, True) - activation_bytes_per_token(s1, 2, True))
    assert abs(extra / 1e9 - 4.6) < 0.6
    assert activation_bytes_per_token(s1, 2, False, True) == activation_bytes_per_token(s1, 2, False)


def test_layers_without_checkpointing_fit_the_budget():
    """As many whole layers as the budget holds at tokens x bytes per token each, none without a budget, at most
    every layer."""
    from opdkit.memory import layers_without_checkpointing

    per_layer = 1000 * 120
    assert layers_without_checkpointing(5 * per_layer, 1000, 120, 28) == 5
    assert layers_without_checkpointing(5 * per_layer - 1, 1000, 120, 28) == 4
    assert layers_without_checkpointing(10**15, 1000, 120, 28) == 28
    assert layers_without_checkpointing(0, 1000, 120, 28) == 0
    assert layers_without_checkpointing(-5, 1000, 120, 28) == 0


def test_unchecked_layers_keep_what_the_estimate_says_a_layer_saves(students):
    """models.checkpoint_all_but_last under gradient checkpointing: each layer it leaves unchecked adds the
    activations memory.layer_activation_bytes estimates (within 10%, against what autograd saves; its input, which a
    checkpointed layer keeps too, aside), and a checkpointed layer little."""
    from opdkit.memory import layer_activation_bytes
    from opdkit.models import checkpoint_all_but_last, enable_checkpointing

    torch.manual_seed(0)
    model = load_model(students["fixture"], torch.device("cpu"), trainable=True).train()
    enable_checkpointing(model, keep_attention=False)
    layers = unwrap(model)[0].layers
    s = model_shape(students["fixture"])
    B, S = 2, 96
    ids_B_S = torch.randint(0, 30, (B, S))
    checkpoint_all_but_last(layers, 0)
    base = saved_activation_bytes(model, ids_B_S)
    assert base < 0.2 * B * S * layer_activation_bytes(s.hidden, s.kv, s.intermediate, 4) * len(layers)
    for n in sorted({1, len(layers)}):
        checkpoint_all_but_last(layers, n)
        assert [lay.gradient_checkpointing for lay in layers] == [i < len(layers) - n for i in range(len(layers))]
        extra = saved_activation_bytes(model, ids_B_S) - base
        est = n * B * S * (layer_activation_bytes(s.hidden, s.kv, s.intermediate, 4) - 4 * s.hidden)  # (the
        assert 0.9 < est / extra < 1.1, (n, est, extra)  # input: kept by a checkpointed layer too)


def test_uncheck_layers_leaves_unchecked_as_many_layers_as_the_spare_memory_holds(students, monkeypatch):
    """step.uncheck_layers: the share of the device memory a checkpointed update leaves free (free less
    memory.checkpointed_update_bytes), over the micro-batch's tokens (real tokens with unpadded rows, every position
    otherwise) x a layer's bytes per token; nothing without free memory (a CPU) or spare memory."""
    from opdkit import memory, step
    from opdkit.models import enable_checkpointing
    from opdkit.scoring import build_geometry

    model = load_model(students["fixture"], torch.device("cpu"), trainable=True).train()
    enable_checkpointing(model, keep_attention=False)
    layers = unwrap(model)[0].layers
    s = model_shape(students["fixture"])
    assert memory.shape_of(model) == s
    g = build_geometry(torch.tensor([[0, 5, 6], [7, 8, 9]]), torch.tensor([[0, 1, 1], [1, 1, 1]]),
                       torch.randint(5, 30, (2, 4)), torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]]))
    real, every = int(g.attention_mask_B_S.sum()), g.input_ids_B_S.numel()
    assert real < every
    per_token = memory.layer_activation_bytes(s.hidden, s.kv, s.intermediate, 4)
    uncheck = lambda unpadded: step.uncheck_layers(model, g, 0.5, unpadded, keep_attention=True, chunk=3)[0]  # noqa: E731
    assert uncheck(True) == 0  # the CPU: no free device memory counted
    assert all(lay.gradient_checkpointing for lay in layers)
    reserve = 4 * s.trainable + real * memory.activation_bytes_per_token(s, 4, True, True) + 3 * 4 * 2 * 3 * s.rows
    assert memory.checkpointed_update_bytes(s, real, 2, 3, 4, True) == reserve
    assert len(layers) == 2
    free = reserve + 2 * real * per_token  # half of the spare memory: 1 layer at the real tokens
    monkeypatch.setattr(memory, "free_device_bytes", lambda device: free)
    assert uncheck(True) == 1
    assert [lay.gradient_checkpointing for lay in layers] == [True, False]
    spare = free - memory.checkpointed_update_bytes(s, every, 2, 3, 4, True)
    assert uncheck(False) == (spare // 2) // (every * per_token) == 0
    monkeypatch.setattr(memory, "free_device_bytes", lambda device: free + 2 * 9 * real * per_token)
    assert uncheck(True) == 2  # at most every layer
    monkeypatch.setattr(memory, "free_device_bytes", lambda device: reserve - 1)
    assert uncheck(True) == 0
    # runtime.checkpoint_keep_matmuls: the share first keeps layers' matmuls, then leaves some of those unchecked
    kept = memory.kept_matmul_bytes(s.hidden, s.kv, s.intermediate, 4)
    plan = lambda: step.uncheck_layers(model, g, 0.5, True, keep_attention=True, chunk=3, keep_matmuls=True)  # noqa: E731
    monkeypatch.setattr(memory, "free_device_bytes", lambda device: reserve + 2 * real * kept)
    assert plan() == (0, 1)  # half the spare memory: one layer's matmuls
    assert [lay.gradient_checkpointing for lay in layers] == [True, True]
    assert "context_fn" in layers[1]._gradient_checkpointing_func.keywords
    assert "context_fn" not in getattr(layers[0]._gradient_checkpointing_func, "keywords", {})
    monkeypatch.setattr(memory, "free_device_bytes", lambda device: reserve + 2 * real * (2 * kept + per_token - kept))
    assert plan() == (1, 1)  # both keep their matmuls; the rest unchecks the last
    assert [lay.gradient_checkpointing for lay in layers] == [True, False]
    monkeypatch.setattr(memory, "free_device_bytes", lambda device: reserve - 1)
    assert plan() == (0, 0) and all(lay.gradient_checkpointing for lay in layers)  # and back to enable_checkpointing's
    assert all("context_fn" not in getattr(lay._gradient_checkpointing_func, "keywords", {}) for lay in layers)


def matmul_output_bytes(layer, x_B_S_H: torch.Tensor, position_embeddings) -> int:
    """Bytes of the outputs of the ops whose outputs a layer keeping its matmuls saves (``models.MATMUL_OPS``: the
    projections' matrix products, a LoRA adapter's included) in one forward of ``layer``, counted as they run."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from opdkit.models import MATMUL_OPS

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if str(func).rsplit(".", 1)[0] in MATMUL_OPS:
                Count.n += out.numel() * out.element_size()
            return out

    with Count():
        layer(x_B_S_H, attention_mask=None, position_embeddings=position_embeddings)
    return Count.n


def test_a_layer_keeping_its_matmuls_saves_what_the_estimate_counts_and_twice_that_under_lora(students):
    """memory.kept_matmul_bytes against the matrix products' outputs of one layer's forward, counted as they run: the
    same bytes for the fully trained student; with LoRA on every projection each adapter adds an output as wide as its
    projection's (and a rank-wide one), about twice the estimate: why step.uncheck_layers keeps no matmuls there."""
    from peft import LoraConfig, get_peft_model

    from opdkit.memory import kept_matmul_bytes, shape_of

    model = load_model(students["fixture"], torch.device("cpu"), trainable=True)
    s = shape_of(model)
    B, S = 2, 16
    x_B_S_H = torch.randn(B, S, s.hidden)
    decoder = unwrap(model)[0]
    pe = decoder.rotary_emb(x_B_S_H, torch.arange(S)[None].expand(B, S))
    est = B * S * kept_matmul_bytes(s.hidden, s.kv, s.intermediate, 4)
    assert matmul_output_bytes(decoder.layers[0], x_B_S_H, pe) == est
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # S2's, the OPSD recipe's
    r, fp32 = 4, 4
    wrapped = get_peft_model(model, LoraConfig(r=r, target_modules=every, task_type="CAUSAL_LM"))
    # each adapter: lora_B's output as wide as its projection's, lora_A's r wide
    assert matmul_output_bytes(unwrap(wrapped)[0].layers[0], x_B_S_H, pe) == 2 * est + B * S * r * len(every) * fp32


def test_uncheck_layers_keeps_no_matmuls_of_a_lora_student(students, monkeypatch):
    """step.uncheck_layers with keep_matmuls under LoRA: the plan a keep_matmuls=False call makes (unchecked layers
    only), where a fully trained student's plan at the same spare memory keeps one layer's matmuls."""
    from peft import LoraConfig, get_peft_model

    from opdkit import memory, step
    from opdkit.models import enable_checkpointing
    from opdkit.scoring import build_geometry

    g = build_geometry(torch.tensor([[0, 5, 6], [7, 8, 9]]), torch.tensor([[0, 1, 1], [1, 1, 1]]),
                       torch.randint(5, 30, (2, 4)), torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]]))
    real = int(g.attention_mask_B_S.sum())
    plans = {}
    for lora in (False, True):
        model = load_model(students["fixture"], torch.device("cpu"), trainable=True).train()
        enable_checkpointing(model, keep_attention=True)
        if lora:
            model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "down_proj"],
                                                     task_type="CAUSAL_LM"))
        s = memory.shape_of(model)
        assert (s.trainable < s.params) == lora
        reserve = memory.checkpointed_update_bytes(s, real, 2, 3, 4, True)
        kept = memory.kept_matmul_bytes(s.hidden, s.kv, s.intermediate, 4)
        free = reserve + 2 * real * kept
        monkeypatch.setattr(memory, "free_device_bytes", lambda device, free=free: free)
        plans[lora] = [step.uncheck_layers(model, g, 0.5, True, keep_attention=True, chunk=3, keep_matmuls=keep)
                       for keep in (True, False)]
    assert plans[False] == [(0, 1), (0, 0)]  # half the spare memory: one layer's matmuls, or no layer unchecked
    assert plans[True] == [(0, 0), (0, 0)]


def test_the_layer_plan_keeps_matmuls_first_then_leaves_layers_unchecked():
    """memory.layer_plan: as many layers as the budget holds keep their matmuls (kept bytes each); of those, as many
    as the rest holds at the difference run unchecked; never more than the layers; without kept bytes, unchecked
    only (layers_without_checkpointing)."""
    from opdkit.memory import kept_matmul_bytes, layer_activation_bytes, layer_plan

    tokens, full, kept = 1000, 120, 40
    assert layer_plan(0, tokens, full, kept, 28) == (0, 0)
    assert layer_plan(-5, tokens, full, kept, 28) == (0, 0)
    assert layer_plan(3 * tokens * kept, tokens, full, kept, 28) == (0, 3)
    assert layer_plan(3 * tokens * kept - 1, tokens, full, kept, 28) == (0, 2)
    assert layer_plan(28 * tokens * kept + 2 * tokens * (full - kept), tokens, full, kept, 28) == (2, 26)
    assert layer_plan(28 * tokens * full, tokens, full, kept, 28) == (28, 0)
    assert layer_plan(10**15, tokens, full, kept, 28) == (28, 0)
    assert layer_plan(5 * tokens * full, tokens, full, 0, 28) == (5, 0)
    # S1 at 7,168 new tokens on an H200 (~58,300 tokens, the 1.5B shape, bf16 autocast), ~54 GB spare: a kept layer
    # 58,300 x 46,080 B = 2.69 GB (20 fit; the 0.27 GB left unchecks none: 58,300 x 75,776 B = 4.42 GB each), an
    # unchecked one 58,300 x 121,856 B = 7.10 GB (7 fit)
    full, kept = layer_activation_bytes(1536, 256, 8960, 2), kept_matmul_bytes(1536, 256, 8960, 2)
    assert layer_plan(54 * 10**9, 58_300, full, kept, 28) == (0, 20)
    assert layer_plan(54 * 10**9, 58_300, full, 0, 28) == (7, 0)
