"""The vLLM engine: its pure parts here, vLLM itself only where it and CUDA exist.

vLLM runs neither on the CPU machines nor on the GPU machine these tests see (no network there,
and its wheel is too large to bring), so the conversion of vLLM outputs to a ``Rollout`` is
checked with stand-ins that mimic vLLM's ``RequestOutput`` / ``CompletionOutput`` / ``Logprob``;
the real engine test skips unless ``vllm`` and CUDA are importable.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
from dataclasses import dataclass, field

import pytest
import torch

from opdkit.config import load_config
from opdkit.rollout import HFEngine, RolloutEngine, make_engine
from opdkit.vllm_engine import VLLMEngine, merged_weights, request_params, to_rollout

PAD, EOS = 0, 2
HAVE_VLLM = importlib.util.find_spec("vllm") is not None and torch.cuda.is_available()


# stand-ins with the fields of vllm.outputs.RequestOutput / CompletionOutput and vllm.logprobs.Logprob
@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: None
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: dict = field(default_factory=dict)


def completion(index: int, ids: list[int], lps: list[float], finish: str) -> CompletionOutput:
    # logprobs=0: each position maps the sampled token (and only it) to its Logprob
    return CompletionOutput(index, "", ids, sum(lps), [{t: Logprob(lp, rank=1)} for t, lp in zip(ids, lps)], finish,
                            EOS if finish == "stop" else None)


def test_vllm_outputs_become_a_rollout_laid_out_like_the_hf_engines():
    prompts = [[5, 6, 7], [8, 9]]
    outputs = [
        RequestOutput("0", None, [5, 6, 7], None, [  # samples listed out of order: index decides
            completion(1, [10, 11, 12, 13], [-0.1, -0.2, -0.3, -0.4], "length"),
            completion(0, [10, EOS], [-0.5, -0.6], "stop"),
        ]),
        RequestOutput("1", None, [8, 9], None, [
            completion(0, [EOS], [-0.7], "stop"),
            completion(1, [14, 15, EOS], [-0.8, -0.9, -1.0], "stop"),
        ]),
    ]
    ro = to_rollout(outputs, prompts, 2, PAD, [EOS])
    assert ro.prompt_ids_B_Sp.tolist() == [[5, 6, 7], [5, 6, 7], [PAD, 8, 9], [PAD, 8, 9]]  # left-padded
    assert ro.prompt_mask_B_Sp.tolist() == [[1, 1, 1], [1, 1, 1], [0, 1, 1], [0, 1, 1]]
    assert ro.completion_ids_B_T.tolist() == [[10, EOS, PAD, PAD], [10, 11, 12, 13], [EOS, PAD, PAD, PAD],
                                              [14, 15, EOS, PAD]]
    assert ro.completion_mask_B_T.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0]]
    assert torch.allclose(ro.sampling_logp_B_T, torch.tensor([[-0.5, -0.6, 0, 0], [-0.1, -0.2, -0.3, -0.4],
                                                              [-0.7, 0, 0, 0], [-0.8, -0.9, -1.0, 0]]))
    assert ro.truncated_B.tolist() == [False, True, False, False]  # the cap without an EOS
    assert ro.prompt_index_B.tolist() == [0, 0, 1, 1] and ro.n_tokens == 2 + 4 + 1 + 3


def test_a_mismatched_vllm_output_is_refused():
    good = RequestOutput("0", None, [5], None, [completion(0, [EOS], [-0.1], "stop")])
    with pytest.raises(ValueError, match="another prompt"):
        to_rollout([good], [[6]], 1, PAD, [EOS])
    with pytest.raises(ValueError, match="expected 2"):
        to_rollout([good], [[5]], 2, PAD, [EOS])
    no_lp = RequestOutput("0", None, [5], None, [CompletionOutput(0, "", [EOS], None, None, "stop")])
    with pytest.raises(ValueError, match="logprobs=0"):
        to_rollout([no_lp], [[5]], 1, PAD, [EOS])


def test_request_params_ask_for_g_samples_per_prompt_with_the_prompts_seed():
    seeds = [11, 12, 13, 21, 22, 23]
    params = request_params(2, samples_per_prompt=3, seeds=seeds, temperature=0.7, top_p=0.9, max_new_tokens=64,
                            eos_ids=[EOS])
    assert params == [
        dict(n=3, temperature=0.7, top_p=0.9, max_tokens=64, seed=11, logprobs=0, stop_token_ids=[EOS], detokenize=False),
        dict(n=3, temperature=0.7, top_p=0.9, max_tokens=64, seed=21, logprobs=0, stop_token_ids=[EOS], detokenize=False),
    ]
    with pytest.raises(ValueError, match="one seed per sample"):
        request_params(2, samples_per_prompt=3, seeds=seeds[:5], temperature=1.0, top_p=1.0, max_new_tokens=8, eos_ids=[EOS])


def test_the_weights_pushed_into_vllm_are_the_exported_ones(tiny_llama):
    """LoRA merged, named as the base model's: exactly what a published checkpoint holds."""
    from peft import LoraConfig, get_peft_model

    from opdkit.setup import export_state_dict

    model = get_peft_model(copy.deepcopy(tiny_llama), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    pushed, exported = dict(merged_weights(model)), export_state_dict(model)
    assert pushed.keys() == {k for k in exported if k != "lm_head.weight" or k in pushed}
    for k, v in pushed.items():
        assert torch.allclose(v, exported[k], atol=1e-6), k
    assert not torch.allclose(pushed["model.layers.0.self_attn.q_proj.weight"],
                              tiny_llama.state_dict()["model.layers.0.self_attn.q_proj.weight"])


def test_the_hf_and_vllm_engines_are_interchangeable():
    def params(cls, method):  # names and kinds (positional / keyword-only), not annotations
        return [(p.name, p.kind) for p in inspect.signature(getattr(cls, method)).parameters.values()]

    for method in ("sample", "sync_weights"):
        assert params(VLLMEngine, method) == params(HFEngine, method) == params(RolloutEngine, method), method


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM and CUDA are present")
def test_without_vllm_the_engine_says_what_to_install(tiny_llama, tok):
    with pytest.raises((ImportError, RuntimeError), match=r"\.\[vllm\]|CUDA"):
        make_engine(load_config(None, ["rollout.engine=vllm"]), tiny_llama, tok)


@pytest.mark.gpu
@pytest.mark.skipif(not HAVE_VLLM, reason="needs vllm and CUDA (pip install -e '.[vllm]' on a GPU machine)")
def test_vllm_samples_the_live_student():
    from opdkit import opd
    from opdkit.embedded import asset
    from opdkit.models import load_model, load_tokenizer
    from opdkit.teacher import completion_hidden, token_logprobs, unwrap

    cfg = load_config(None, ["rollout.engine=vllm", "rollout.gpu_memory_utilization=0.2"])
    tok = load_tokenizer(asset("student"))
    model = load_model(asset("student"), torch.device("cuda"), trainable=True)
    engine = make_engine(cfg, model, tok)
    assert isinstance(engine, VLLMEngine)
    prompts = [tok("12+34=", add_special_tokens=False).input_ids, tok("7*8=", add_special_tokens=False).input_ids]
    kw = dict(samples_per_prompt=3, seeds=opd.step_seeds(0, 0, 6), temperature=1.0, top_p=1.0, max_new_tokens=32)
    ro = engine.sample(prompts, **kw)
    assert ro.completion_ids_B_T.shape[0] == 6 and ro.prompt_index_B.tolist() == [0, 0, 0, 1, 1, 1]
    # the sampling log-probs are the raw model's (bf16 sampling vs fp32 recompute)
    g = opd.student_geometry(opd.Batch(ro, ro.prompt_ids_B_Sp, ro.prompt_mask_B_Sp))
    with torch.no_grad():
        logp = token_logprobs(unwrap(model)[1], completion_hidden(model, g), ro.completion_ids_B_T, 2048)
    m = ro.completion_mask_B_T.bool()
    assert (logp - ro.sampling_logp_B_T).abs()[m].max() < 0.1
    assert torch.equal(engine.sample(prompts, **kw).completion_ids_B_T, ro.completion_ids_B_T)  # seeded
    with torch.no_grad():  # a pushed update changes what is sampled
        unwrap(model)[1].weight.mul_(0.0)
    engine.sync_weights(model)
    assert not torch.equal(engine.sample(prompts, **kw).completion_ids_B_T, ro.completion_ids_B_T)
