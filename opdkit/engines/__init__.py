"""Rollout engines: the student samples completions for P prompts x G samples.

Layers, lowest first (each imports only those before it):

- ``sampling``: seeded per-row sampling (counter-based Gumbel noise, top-p) — pure tensor math;
- ``base``: the ``Rollout`` type, the ``RolloutEngine`` protocol, padding and EOS helpers;
- ``weights``: ``merged_weights``, the one place a model's LoRA deltas are folded into base-named
  weights (weight sync into the static decoder or vLLM, checkpoint export, FSDP2 gathering);
- ``static``: the static-KV-cache CUDA-graph decoder on a bf16 inference copy;
- ``hf``: ``HFEngine`` (``model.generate`` or the static decoder);
- ``vllm``: ``VLLMEngine`` (the ``vllm`` extra);
- ``vllm_teacher``: the teacher in vLLM (``teacher.source: vllm``): a server client or a colocated
  engine scoring through prompt log-probs, and ``vocab_cut``;
- ``sharded``: an engine over an FSDP2-sharded policy;
- ``select``: ``make_engine`` (``rollout.engine: auto | hf | vllm``).
"""
