"""Typed, frozen run configuration: every knob and its one default live here.

``load_config`` reads a YAML file (missing keys take the defaults below, unknown keys are an error),
then applies ``key=value`` overrides with dotted paths, type-checking each value; errors name the key
and the expected type. The pipeline's ``params.yaml`` holds the keys its stages track at these
defaults and the study's overlay, the keys marked ``# study:`` (docs/design.md, "Params").
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from opdkit.loss_table import LOSS_NAMES


class ConfigError(ValueError):
    """A params file or override that does not fit the schema (the message names the key)."""


def check_at_least(section: str, bounds: dict[str, tuple[float, float, str]]) -> None:
    """``ConfigError`` naming the first key of ``section`` whose value is below its lowest, or NaN
    (``bounds``: key -> (its value, the lowest allowed, what that lowest value means or ""))."""
    for key, (value, low, meaning) in bounds.items():
        if not value >= low:  # NaN fails too
            raise ConfigError(f"params key '{section}.{key}': expected >= {low:g}{meaning and ' (' + meaning + ')'}, "
                              f"got {value!r}")


def parse_size(text: str, key: str = "max_shard_size") -> int:
    """``"5GB"`` -> bytes (units as ``save_pretrained``: KB, MB, GB = powers of 1000; KiB ... of 1024)."""
    from huggingface_hub.serialization._base import parse_size_to_int

    try:
        n = parse_size_to_int(str(text))
    except ValueError:
        n = 0
    if n <= 0:
        raise ValueError(f"{key}: expected a size such as 5GB or 500MB, got {text!r}")
    return n


SFT_SOURCES = ("teacher", "reference")  # loss.sft_source (and a pipeline control arm's sft_source)


@dataclass(frozen=True)
class ModelConfig:
    path: str = ""  # HF directory; "" = the embedded default


@dataclass(frozen=True)
class TeacherConfig:
    path: str = ""  # HF directory; "" = the embedded teacher (ignored by privileged sources)
    # model: a separate frozen HF model; vllm: the teacher in vLLM, scoring through prompt log-probs
    # (opdkit.engines.vllm_teacher: a colocated engine, or the server at `url`); privileged_fixed /
    # privileged_ema / privileged_live: the student itself, given the reference solution in its prompt
    # (fixed initial copy, EMA, live).
    source: str = "model"
    ema_decay: float = 0.99  # privileged_ema: teacher <- decay*teacher + (1-decay)*student per step
    # source=model: where the teacher's weights live and it runs; "" = the student's device. cpu | cuda |
    # cuda:N (one process: a student on cuda:0 and the teacher on cuda:1); its scores move to the student's.
    device: str = ""
    # source=vllm: "" = a vLLM engine in its own process on the student's GPU (asleep between scorings);
    # else the base URL of a vLLM OpenAI-compatible server serving the teacher (`vllm serve DIR`)
    url: str = ""
    gpu_memory_utilization: float = 0.3  # source=vllm, colocated: the engine's share of the GPU
    timeout_s: float = 120.0  # source=vllm with a url: seconds to wait for one scoring request
    # shared: the teacher scores the student's token ids (one vocabulary); own: cross-tokenizer OPD (opdkit.xtok):
    # the teacher's tokenizer re-tokenizes each completion's text (its prompt rendered with its own template),
    # the two tokenizations aligned into spans (loss_table.XTOK: how each loss runs across tokenizers)
    tokenizer: str = "shared"
    # own, full-distribution losses: how the teacher's ids map onto the student's (opdkit.xtok_loss): prefix (the
    # student token that starts the teacher token's text) | exact (identical bytes only, GOLD's match)
    vocab_map: str = "prefix"
    # What the teacher returns follows from loss.name (opdkit.loss_table): sampled-token log-probs
    # (k1, k2, k3, sft), top-k (topk_fkl, K = loss.topk) or the full vocabulary (fkl, rkl, jsd, topk_rkl; chunked).


@dataclass(frozen=True)
class TeacherSpec:
    """One of several teachers (params key ``teachers``): the rows whose ``data.teacher_column`` is
    ``name`` are scored by the model at ``path`` (or, with teacher.source=vllm, the server at ``url``,
    "" = a colocated engine), with every other teacher.* setting shared."""

    name: str = ""
    path: str = ""
    url: str = ""

    def __post_init__(self):
        if not self.name or not self.path:
            raise ConfigError(f"params key 'teachers': each entry needs a name and a path (an HF directory); got "
                              f"name={self.name!r}, path={self.path!r}")


@dataclass(frozen=True)
class FilterConfig:
    """Training-row selection (``opdkit.data.select``), applied in this order; each 'keep' is of the
    rows that passed the ones before, and the table's order is kept."""

    answer_regex: str = ""  # keep rows whose answer (whitespace stripped) fully matches this; "" = all. OPSD: -?\d{1,6}
    exclude_sources: tuple[str, ...] = ()  # drop rows whose source (source / data_source column) is one of these
    reference: str = "solution"  # the text the length filters count: solution | cot (the COT_Reason trace)
    min_reference_tokens: int = 0  # keep rows whose reference has >= this many tokens (the student's tokenizer)
    top_reference_fraction: float = 1.0  # then keep this share of the rows, longest references first (0.5: upper half)

    def __post_init__(self):
        try:
            re.compile(self.answer_regex)
        except re.error as e:
            raise ConfigError(f"params key 'data.filters.answer_regex': {self.answer_regex!r} is not a regular "
                              f"expression ({e})") from None
        if not 0.0 < self.top_reference_fraction <= 1.0:
            raise ConfigError("params key 'data.filters.top_reference_fraction': expected a share in (0, 1], got "
                              f"{self.top_reference_fraction}")
        if self.min_reference_tokens < 0:
            raise ConfigError("params key 'data.filters.min_reference_tokens': expected >= 0, got "
                              f"{self.min_reference_tokens}")


@dataclass(frozen=True)
class HFOrderConfig:
    """``data.order=hf_trainer``: how the Hugging Face ``Trainer`` the run replays fed its processes
    (``opdkit.data.hf_trainer_rows``). Each process draws epoch e's order with ``torch.randperm`` from
    a generator seeded with its seed + e (accelerate's ``SeedableRandomSampler``) and takes batches
    r, r + W, r + 2W, ... of ``device_batch`` rows of it (``BatchSamplerShard``); a step is
    ``rollout.prompts_per_step`` rows, ``device_batch`` x gradient accumulation x ``processes``."""

    processes: int = 1  # W: accelerate's processes (GPUs)
    device_batch: int = 0  # per_device_train_batch_size; 0 = prompts_per_step / processes (no gradient accumulation)
    # each process's seed: seed (the params' seed on every process: torch's initial seed after the Trainer's
    # set_seed) | vllm_rank (process r's is r: a colocated vLLM engine built in the process after the Trainer,
    # as the released OPSD trainer's, reseeds torch with seed=process_index before the dataloader is made)
    rank_seeds: str = "seed"

    def __post_init__(self):
        if self.processes < 1 or self.device_batch < 0:
            raise ConfigError(f"params key 'data.hf_order': processes must be >= 1 and device_batch >= 0; got "
                              f"{self.processes} and {self.device_batch}")


@dataclass(frozen=True)
class DataConfig:
    train: str = ""  # parquet/jsonl; "" = the embedded train split
    eval: str = ""  # parquet/jsonl; "" = the embedded eval split
    # raw (the prompt as given) | boxed | answer_line | opsd_student | opsd_eval (opdkit.data.PROMPT_TEMPLATES)
    prompt_format: str = "raw"
    chat_template: bool = False
    filters: FilterConfig = field(default_factory=FilterConfig)
    max_rows: int = 0  # 0 = all rows (after filtering)
    # shuffled (a fresh seeded shuffle per epoch) | stored (the table's order, as S1's shuffle=False) | hf_trainer
    # (the Hugging Face Trainer's sampler from the seed, as the released OPSD trainer fed its processes: data.hf_order)
    order: str = "shuffled"
    hf_order: HFOrderConfig = field(default_factory=HFOrderConfig)
    # Privileged teachers (teacher.source=privileged_*): what the teacher's prompt holds beside the problem,
    # solution | cot (the COT_Reason trace) | both, and how it is written: hint (the student's prompt plus
    # opdkit's reference-solution hint) | opsd (the first OPSD release's collator's teacher message) |
    # opsd_delimited (the message of the release with the thinking switches: opdkit.data.OPSD_TEACHER_TEMPLATES)
    teacher_context: str = "solution"
    teacher_prompt: str = "hint"
    # Passed to the chat template as enable_thinking (data.chat_template=true): the student's prompts, which a
    # teacher model scores too, and a privileged teacher's. Qwen3's template opens the answer with an empty
    # <think></think> block when false (no thinking) and leaves it to the model when true (its default);
    # Qwen2.5's and DeepSeek-R1-Distill-Qwen's templates do not read it (the prompts are the same either way).
    enable_thinking: bool = True
    teacher_enable_thinking: bool = True
    # How scored sequences are padded: left ([pads][prompt][completion], positions from the mask: where the
    # student sampled) | right ([prompt][pads][completion], the pads consuming RoPE positions: the released
    # OPSD collator's layout, for replaying its offset; the alignment check then fails unless switched off)
    pad_side: str = "left"
    teacher_column: str = ""  # with `teachers`: the column naming each row's teacher (one of their names)

    def __post_init__(self):  # a negative max_rows would slice rows off the end
        check_at_least("data", {"max_rows": (self.max_rows, 0, "0 = all rows")})


@dataclass(frozen=True)
class RolloutConfig:
    engine: str = "auto"  # auto (hf: on CUDA its static decoder, with Triton; vllm where Triton is not) | hf | vllm
    prompts_per_step: int = 16
    samples_per_prompt: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    static_cache: bool = True  # used on CUDA only
    # CUDA, static decoder with Triton: its layers' projections at <= 16 rows through the kit's GEMV kernels
    # (engines.decode_kernels.gemv_launch: weight-streaming, deterministic split-K); false: cuBLAS
    decode_gemv: bool = True
    # CUDA, static decoder with Triton, Hopper or later: its kernels launched with programmatic dependent launch
    # (each launch overlaps the kernel before; no result changes; engines.decode_kernels.pdl_available); false: not
    decode_pdl: bool = True
    batch_size: int = 0  # sequences per decode call (per rank); 0 = the whole step's at once
    gpu_memory_utilization: float = 0.35  # vllm only
    max_prompt_tokens: int = 2048  # vllm only: its max_model_len is this + max_new_tokens
    # 1: one-step-off rollouts (opdkit.overlap): step n+1's samples are drawn by the weights before step n's
    # update while step n scores and updates; token losses correct with the recorded behaviour log-probs. 0: on-policy
    overlap: int = 0
    # live: the student draws each step's samples and the teacher scores them | offline: they are read from
    # offline_file, rollouts of a fixed policy drawn and teacher-scored once by `opdkit offline-rollouts` (no
    # teacher model in the run; opdkit.offline)
    source: str = "live"
    offline_file: str = ""  # source=offline: the pool (parquet) `opdkit offline-rollouts --out FILE` wrote
    # source=offline: k1/k2/k3's old_logp, whose ratio exp(logp - old_logp) weights each stored token: behaviour
    # (the pool policy's recorded log-probs: ratio current student / behaviour) | none (the current student's: ratio 1)
    offline_ratio: str = "behaviour"

    def __post_init__(self):  # temperature 0 is greedy; a negative one would silently be greedy too
        check_at_least("rollout", {"temperature": (self.temperature, 0.0, "0 = greedy"),
                                   "max_new_tokens": (self.max_new_tokens, 1, ""),
                                   "prompts_per_step": (self.prompts_per_step, 1, ""),
                                   "samples_per_prompt": (self.samples_per_prompt, 1, ""),
                                   "batch_size": (self.batch_size, 0, "0 = the whole step's at once")})
        if self.overlap not in (0, 1):
            raise ConfigError(f"params key 'rollout.overlap': expected 0 (on-policy) or 1 (one-step-off rollouts), "
                              f"got {self.overlap!r}")


@dataclass(frozen=True)
class LossConfig:
    name: str = "rkl"  # k1 | k2 | k3 | topk_fkl | topk_rkl | fkl | rkl | jsd | sft (opdkit.loss_table)
    clip_eps: float = 0.2  # PPO ratio clip for k1
    dual_clip: float = 3.0  # k1: PPO dual clip c for negative advantages (loss <= -c A, as verl); 0 = off
    topk: int = 16  # K of topk_fkl (the teacher's top-K) and topk_rkl (the student's top-K)
    tail_bucket: bool = True  # topk_fkl: lump the teacher's remaining mass into one bucket
    jsd_beta: float = 0.5  # 0 = forward KL, 1 = reverse KL
    clip: str = "none"  # none | entry (min(p_T log p_T/p_S, tau) per vocab entry) | token
    clip_tau: float = 0.05
    # fkl / rkl / jsd: the teacher's distribution is softmax(logits / teacher_temperature) (TRL's GKD and the
    # released OPSD temper the teacher by their sampling temperature too; the student is the policy it samples)
    teacher_temperature: float = 1.0
    sft_source: str = "teacher"  # sft control: teacher samples | reference solutions
    # OPD plus a verifiable reward (opdkit.rewards): lambda times each completion's 0/1 grade against its
    # row's answer, centred by its prompt's G samples, in k1's per-token advantage or, for the other
    # losses, a policy-gradient term beside them. 0 = off (no grading: the plain OPD update)
    reward_weight: float = 0.0
    reward_baseline: str = "mean"  # mean (GRPO: the group's mean) | loo (leave-one-out: the other G-1 samples' mean)
    reward_norm: str = "none"  # none | std (divided by the group's standard deviation + 1e-6, as GRPO)

    def __post_init__(self):  # refused with the params, not by the loss function inside the first step
        check_at_least("loss", {"clip_eps": (self.clip_eps, 0.0, ""), "topk": (self.topk, 1, ""),
                                "clip_tau": (self.clip_tau, 0.0, "")})
        if not 0.0 <= self.jsd_beta <= 1.0:
            raise ConfigError(f"params key 'loss.jsd_beta': expected 0 <= beta <= 1 (0 forward KL, 1 reverse KL), "
                              f"got {self.jsd_beta!r}")
        if not (self.dual_clip == 0.0 or self.dual_clip > 1.0):
            raise ConfigError(f"params key 'loss.dual_clip': expected 0 (off) or > 1, got {self.dual_clip!r}")
        if not self.teacher_temperature > 0.0:  # NaN fails too
            raise ConfigError(f"params key 'loss.teacher_temperature': expected > 0, got {self.teacher_temperature!r}")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1.0e-4
    # constant | linear | cosine (by step) | wallclock_cosine (by elapsed share of the wall budget)
    schedule: str = "wallclock_cosine"
    warmup_steps: int = 20
    min_lr: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    micro_batch: int = 0  # sequences per forward/backward; 0 = the whole step at once

    def __post_init__(self):
        if not 0.0 <= self.lr < float("inf"):  # NaN, inf or a negative rate would train to non-finite or away
            raise ConfigError(f"params key 'optim.lr': expected a finite learning rate >= 0, got {self.lr!r}")
        check_at_least("optim", {"min_lr": (self.min_lr, 0.0, ""), "warmup_steps": (self.warmup_steps, 0, ""),
                                 "micro_batch": (self.micro_batch, 0, "0 = the whole step at once"),
                                 "weight_decay": (self.weight_decay, 0.0, "")})


@dataclass(frozen=True)
class LoraConfig:
    enabled: bool = False
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass(frozen=True)
class BudgetConfig:
    max_steps: int = 0  # 0 = no step horizon (the wall clock decides)
    max_wall_time_s: float = 180.0  # 0 = no wall-clock limit
    # seconds of the wall budget kept free at the end beyond what the loop reserves for the saves it will make
    # (measured: the last state save and export; before the first, estimated: opdkit.deadline)
    deadline_reserve_s: float = 10.0
    schedule_steps: int = 0  # horizon for step-based lr schedules; 0 = max_steps
    # With a wall budget: MiB written (fsynced, then removed) into the state and checkpoint directories at
    # start-up to measure the write rate; the saves before the first measured one are reserved at their bytes
    # over that rate, times save_estimate_factor. 0 = no probe (nothing reserved for them)
    write_probe_mb: int = 64
    save_estimate_factor: float = 2.0

    def __post_init__(self):
        check_at_least("budget", {"max_steps": (self.max_steps, 0, "0 = no step horizon"),
                                  "max_wall_time_s": (self.max_wall_time_s, 0.0, "0 = no wall-clock limit"),
                                  "schedule_steps": (self.schedule_steps, 0, "0 = budget.max_steps")})


@dataclass(frozen=True)
class PublishConfig:
    every_steps: int = 50  # the HF export's cadence (checkpoints/checkpoint-<step>); the end is always published
    keep: int = 3
    # the trainer state's cadence (resume): -1 = with every export, 0 = only at the end or before a stop, N = every
    # N steps (opdkit.train: a checkpoint may then be newer than the newest state; a resume replays the steps)
    state_every_steps: int = -1
    keep_states: int = 1  # the newest N trainer states are kept (verl's baseline kept 3)
    retries: int = 5
    backoff_s: float = 0.5
    # weights' dtype in the export: auto (the source student's config dtype) | float32 | bfloat16 | float16
    dtype: str = "auto"
    # larger exports are split into shards + model.safetensors.index.json (as save_pretrained)
    max_shard_size: str = "5GB"

    def __post_init__(self):
        try:  # refused with the params, before `opdkit train` imports torch (not seconds later in its preflight)
            parse_size(self.max_shard_size, "publish.max_shard_size")
        except ValueError as e:
            raise ConfigError(str(e)) from None
        check_at_least("publish", {"every_steps": (self.every_steps, 0, "0 = at the end only"),
                                   "state_every_steps": (self.state_every_steps, -1, "-1 = with every export"),
                                   "retries": (self.retries, 0, ""), "backoff_s": (self.backoff_s, 0.0, ""),
                                   "keep": (self.keep, 1, ""), "keep_states": (self.keep_states, 1, "")})


@dataclass(frozen=True)
class EvalConfig:
    # custom: the keys below as given | a seeded run's protocol (PROTOCOLS below): it sets the keys it fixes
    protocol: str = "custom"
    n_samples: int = 4
    temperature: float = 0.7
    top_p: float = 0.9
    max_new_tokens: int = 64
    batch_size: int = 512  # sequences per decode call at most; fewer where they would not fit in memory (evaluate)
    seed: int = 1234
    max_questions: int = 0  # 0 = every question of the eval split
    prompt_format: str = ""  # "" = data.prompt_format; else one of its choices (the benchmark's prompt)
    # the chat template's enable_thinking for the benchmark's prompts (the released OPSD evaluator's default: true)
    enable_thinking: bool = True
    # hf: the kit's decoder (on CUDA the static-cache one), whole questions per call, as many rows as fit in memory
    # | vllm: a vLLM engine built from the model's directory, every question in one continuously batched call
    # (samples seeded per request by vLLM's sampler: other samples than hf's for the same seeds)
    engine: str = "hf"
    gpu_memory_utilization: float = 0.8  # engine=vllm: its share of the GPU (KV cache and all)

    def __post_init__(self):
        check_at_least("eval", {"temperature": (self.temperature, 0.0, "0 = greedy"),
                                "n_samples": (self.n_samples, 1, ""), "max_new_tokens": (self.max_new_tokens, 1, ""),
                                "max_questions": (self.max_questions, 0, "0 = every question")})
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"params key 'eval.gpu_memory_utilization': expected a share of the GPU in (0, 1], got "
                              f"{self.gpu_memory_utilization!r}")


@dataclass(frozen=True)
class RuntimeConfig:
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (fp32 on CPU, bf16 autocast with fp32 masters on GPU) | float32 | bfloat16
    threads: int = 2  # torch CPU threads (fixed so CPU runs are reproducible; capped at the CPUs this process may use)
    # A non-finite loss or gradient norm: stop (exit 3, nothing new saved) | skip (drop the step's
    # update, log skipped_nonfinite; exit 3 after max_nonfinite_skips consecutive skips).
    on_nonfinite: str = "stop"
    max_nonfinite_skips: int = 3
    grad_checkpointing: bool = False
    # Under grad_checkpointing: keep each layer's attention output (flash attention's result and log-sum-exp) from
    # the forward instead of recomputing it in the backward (models.enable_checkpointing); the same gradients
    checkpoint_keep_attention: bool = True
    # Under grad_checkpointing on a GPU: the share of the memory that a fully checkpointed update would leave free
    # (free when the update's forward starts, less its gradients, checkpointed activations and logits chunk:
    # memory.checkpointed_update_bytes) that decoder layers may fill with their activations instead of being
    # checkpointed: the last layers run unchecked, as many as fit (tokens x memory.layer_activation_bytes each), so
    # a short step recomputes nothing and a long one only what memory requires. The same gradients; 0 = every layer
    # checkpointed. One process only (a sharded student checkpoints every layer).
    unchecked_layers_memory: float = 0.9
    # Under grad_checkpointing with that share: checkpointed layers first keep their projections' outputs too (their
    # recompute then runs only the elementwise ops), as many as the share holds (tokens x memory.kept_matmul_bytes
    # each), and only the rest of it leaves layers unchecked (memory.layer_plan). The same gradients; false = the
    # share leaves layers unchecked only, as it does for a LoRA student (its adapters' outputs would double what a
    # layer keeps: step.uncheck_layers). On: S1's full steps at 7,168 new tokens 0.03-0.05 s faster on an H200, the
    # same on an H100, 2-9 GB more at the peak (BENCHMARKS.md, "2026-12-05 (fourteenth session)")
    checkpoint_keep_matmuls: bool = True
    logprob_chunk: int = 2048  # positions per chunk when computing log-softmax over the vocab
    # Score and train each sequence on its own, trimmed of its pads: attention then runs causal with
    # no mask (flash kernels) instead of a masked kernel over the padded S x S square. For long
    # sequences on GPU; many short rows (the embedded default on CPU) are faster batched.
    unpadded_rows: bool = False
    alignment_check: bool = True  # check teacher/student alignment on the first batch (stops the run if it fails)
    alignment_every: int = 0  # also every N-th step (N > 0); 0 = the first batch of each start only
    # allowed (max, mean) |recomputed - sampling-time log-prob| of the sampled tokens in that check, over the
    # tokens inside the recomputed nucleus, by compute dtype: fp32 recomputes agree to ~1e-6; bf16 kernels (and
    # vLLM) differ by up to ~1 on rare tokens
    alignment_tol_fp32: tuple[float, float] = (1.0e-3, 1.0e-4)
    alignment_tol_bf16: tuple[float, float] = (2.0, 0.05)
    # allowed share of the sampled tokens that the update gives weight 0: outside the top-p nucleus recomputed
    # from the current logits (rounding and ties at the nucleus' edge: ~0.1% measured with vLLM at top-p 0.95)
    alignment_max_weight0_share: float = 0.01
    # torchrun: replicate (a full teacher per rank) | fsdp (sharded like the student)
    teacher_sharding: str = "replicate"
    state_dir: str = ""  # where the trainer state (resume) lives; "" = OUT/state (run.sh: CKPT_DIR)
    # The GPU workload lock (opdkit.persist.fsutil.DeviceLock; its file: $OPDKIT_GPU_LOCK, else one per machine):
    # training holds it shared, `opdkit eval` exclusively; a conflicting command exits 75.
    # auto: on CUDA devices | always (CPU runs too) | never
    device_lock: str = "auto"
    # torchrun: a collective that waits longer than this for another rank ends the run (exit 1, run.json
    # names the phase); it must exceed the longest legitimate wait (a rank's rollout outlasting another's)
    collective_timeout_s: float = 300.0

    def __post_init__(self):
        check_at_least("runtime", {"threads": (self.threads, 0, "0 = torch's default"),
                                   "logprob_chunk": (self.logprob_chunk, 1, "")})
        if self.max_nonfinite_skips < 0:
            raise ConfigError(f"runtime.max_nonfinite_skips must be >= 0, got {self.max_nonfinite_skips}")
        if self.alignment_every < 0:
            raise ConfigError(f"params key 'runtime.alignment_every': expected >= 0 (0 = the first batch of each "
                              f"start only), got {self.alignment_every}")
        if not 0.0 <= self.unchecked_layers_memory <= 1.0:
            raise ConfigError("params key 'runtime.unchecked_layers_memory': expected a share in [0, 1] of the GPU "
                              f"memory a checkpointed update leaves free (0 = every layer checkpointed), got "
                              f"{self.unchecked_layers_memory}")
        if not 0.0 <= self.alignment_max_weight0_share <= 1.0:
            raise ConfigError("params key 'runtime.alignment_max_weight0_share': expected a share in [0, 1], got "
                              f"{self.alignment_max_weight0_share}")


@dataclass(frozen=True)
class StudiesConfig:
    n_prompts: int = 64
    samples_per_prompt: int = 2
    # pads between prompt and completion; the OPSD log measured k = 200 on Qwen3-1.7B and a mean offset of 292
    padding_k: tuple[int, ...] = (0, 1, 2, 4, 8, 16, 32, 64, 128, 200, 292)
    clip_tau: tuple[float, ...] = (0.0, 0.001, 0.01, 0.05, 0.1, 0.5, 1.0, float("inf"))
    kl_bins: tuple[float, ...] = (0.0, 0.01, 0.1, 0.5, 1.0, float("inf"))


@dataclass(frozen=True)
class DoctorConfig:
    """``opdkit doctor``'s live checks run on one batch of the student's rollouts: the first
    ``n_prompts`` prompts of the data, one sample each, at most ``max_new_tokens`` tokens (and at
    most ``rollout.max_new_tokens``), at ``rollout.temperature`` / ``rollout.top_p``."""

    n_prompts: int = 4
    max_new_tokens: int = 32
    # teacher.tokenizer=own: data rows (their reference solutions) the span alignment is measured on
    xtok_rows: int = 64


@dataclass(frozen=True)
class ControlArm:
    """A supervised control arm of the pipeline (``loss.name=sft``), trained over ``pipeline.seeds``
    beside the OPD arms; its runs are ``runs/train/<name>/seed<n>`` and its evals are tagged ``arm=<name>``."""

    name: str = "sft_teacher"
    sft_source: str = "teacher"  # its loss.sft_source: teacher samples | reference solutions
    steps: int = 120  # its budget.max_steps (the lr schedule's horizon too)
    every_steps: int = 30  # its publish.every_steps: the checkpoints of its learning curve
    # steps: `steps` = budget.max_steps (matched steps); wall: `steps` calibrated so that the arm
    # trains as long as the baseline arm's budget.max_steps (python -m opdkit.stages.calibrate)
    match: str = "steps"

    def __post_init__(self):
        for key, allowed in (("sft_source", SFT_SOURCES), ("match", ("steps", "wall"))):
            if getattr(self, key) not in allowed:
                raise ConfigError(f"params key 'pipeline.controls' (arm {self.name!r}): {key} must be one of "
                                  f"{', '.join(allowed)}; got {getattr(self, key)!r}")
        if self.steps < 1 or self.every_steps < 1:
            raise ConfigError(f"params key 'pipeline.controls' (arm {self.name!r}): steps and every_steps must be "
                              f">= 1; got {self.steps} and {self.every_steps}")


@dataclass(frozen=True)
class PipelineConfig:
    seeds: tuple[int, ...] = (0, 1, 2)
    baseline_arm: str = "rkl"  # the OPD arms are loss.name and this one, each at budget.max_steps
    controls: tuple[ControlArm, ...] = (
        # calibrated on the embedded default (params.yaml says how)
        ControlArm("sft_teacher", "teacher", 138, 46, "wall"),
        ControlArm("sft_reference", "reference", 120, 40, "steps"),
    )


@dataclass(frozen=True)
class EmbeddedConfig:
    """How ``opdkit embedded --rebuild`` makes the task and the tiny models (fixed step counts, so
    the same seed gives identical files whatever else the machine is doing)."""

    seed: int = 0
    n_train: int = 20000
    n_eval: int = 300
    n_ops: int = 3  # operations per problem ("Compute 47+5-29+8."): more steps, more carries
    hidden_size: int = 128
    layers: int = 4
    heads: int = 4
    intermediate_size: int = 512
    batch_size: int = 64
    lr: float = 3.0e-3
    warmup_steps: int = 50
    teacher_steps: int = 1200  # correct solutions, cosine to 0
    # The student: smaller than the teacher (a capacity gap; 0 = the teacher's value). Issue 17's grid
    # (bench/embedded_grid.py, docs/study.md "The embedded task") chose this one: its accuracy barely moves between
    # builds, where the teacher-shaped student from the teacher's run at step 500 swung 0.22-0.35.
    student_hidden_size: int = 96
    student_layers: int = 3
    student_heads: int = 4
    student_intermediate_size: int = 384
    # teacher_run: the student starts from the teacher's run at step student_base_steps (same shape only);
    # scratch: it is trained from random init for student_base_steps steps on reference solutions (cosine lr).
    student_init: str = "scratch"
    student_base_steps: int = 1200
    student_carry_steps: int = 150  # then steps on carry-dropped additions (the planted error; 0 = none)
    student_lr: float = 1.0e-3
    threads: int = 2  # torch CPU threads during the build (fixed: part of what makes it reproducible)
    # the cross-tokenizer teacher (opdkit embedded --bpe-teacher; not part of --rebuild): its byte-level BPE's ids,
    # trained on the train split; the teacher itself follows the teacher recipe above (shape, teacher_steps, lr)
    bpe_vocab_size: int = 384


@dataclass(frozen=True)
class Config:
    seed: int = 0
    recipe: str = ""  # a params overlay under recipes/ applied over this file; "" = none (opdkit.recipes)
    # a label, recorded with the run (checkpoints' opdkit.json, run.json); run.sh: EXPERIMENT_NAME
    experiment_name: str = ""
    # per-step experiment tracking beside metrics/train.jsonl (opdkit.tracking): auto (dvclive where it is
    # installed, else none) | dvclive (OUT/dvclive: dvc plots / metrics) | tensorboard (OUT/tensorboard) | none
    tracking: str = "auto"
    student: ModelConfig = field(default_factory=ModelConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    # several teachers, each prompt routed to the one its row names (data.teacher_column); () = the one
    # teacher of teacher.path
    teachers: tuple[TeacherSpec, ...] = ()
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    publish: PublishConfig = field(default_factory=PublishConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    studies: StudiesConfig = field(default_factory=StudiesConfig)
    doctor: DoctorConfig = field(default_factory=DoctorConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    embedded: EmbeddedConfig = field(default_factory=EmbeddedConfig)


PROMPT_FORMATS = ("raw", "boxed", "answer_line", "opsd_student", "opsd_eval")  # opdkit.data.PROMPT_TEMPLATES
TRACKERS = ("auto", "dvclive", "tensorboard", "none")  # the params key `tracking` (opdkit.tracking)

CHOICES: dict[str, tuple[str, ...]] = {
    "tracking": TRACKERS,
    "teacher.source": ("model", "vllm", "privileged_fixed", "privileged_ema", "privileged_live"),
    "teacher.tokenizer": ("shared", "own"),
    "teacher.vocab_map": ("prefix", "exact"),
    "data.prompt_format": PROMPT_FORMATS,
    "data.order": ("shuffled", "stored", "hf_trainer"),
    "data.hf_order.rank_seeds": ("seed", "vllm_rank"),
    "data.teacher_context": ("solution", "cot", "both"),
    "data.teacher_prompt": ("hint", "opsd", "opsd_delimited"),
    "data.pad_side": ("left", "right"),
    "data.filters.reference": ("solution", "cot"),
    "eval.protocol": ("custom", "math500_proxy", "aime_final", "aime24_avg12"),
    "eval.prompt_format": ("",) + PROMPT_FORMATS,
    "runtime.device_lock": ("auto", "always", "never"),
    "rollout.engine": ("auto", "hf", "vllm"),
    "eval.engine": ("hf", "vllm"),
    "rollout.source": ("live", "offline"),
    "rollout.offline_ratio": ("behaviour", "none"),
    "loss.name": LOSS_NAMES,
    "loss.clip": ("none", "entry", "token"),
    "loss.sft_source": SFT_SOURCES,
    "loss.reward_baseline": ("mean", "loo"),
    "loss.reward_norm": ("none", "std"),
    "optim.schedule": ("constant", "linear", "cosine", "wallclock_cosine"),
    "runtime.device": ("auto", "cpu", "cuda"),
    "runtime.dtype": ("auto", "float32", "bfloat16"),
    "runtime.teacher_sharding": ("replicate", "fsdp"),
    "runtime.on_nonfinite": ("stop", "skip"),
    "publish.dtype": ("auto", "float32", "bfloat16", "float16"),
    "embedded.student_init": ("teacher_run", "scratch"),
}


@dataclass(frozen=True)
class Protocol:
    """A seeded run's evaluation protocol: the ``eval.*`` values it fixes (the others keep theirs), how
    many questions its benchmark has, and where the numbers come from."""

    settings: dict
    n_questions: int
    source: str


# eval.protocol: a preset sets the keys it fixes in the resolved config (whatever the params file or the
# recipe said; a -S that sets one of them to another value is an error: that is eval.protocol=custom).
PROTOCOLS: dict[str, Protocol] = {
    "math500_proxy": Protocol(
        {"n_samples": 4, "temperature": 0.7, "top_p": 0.9, "max_new_tokens": 12288, "seed": 42,
         "prompt_format": "boxed"},
        500, "S1's exploration metric math500_pass_at_1 (seed 000): all 500 MATH-500 questions x 4 samples, "
             "temperature 0.7, top-p 0.9, 12,288 new tokens, generation seed 42, a fixed boxed-answer prompt"),
    "aime_final": Protocol(
        {"n_samples": 32, "temperature": 0.7, "top_p": 0.9, "max_new_tokens": 31744, "seed": 42,
         "prompt_format": "boxed"},
        60, "S1's final metric aime24_25_at32 (seeds 000, 002): 30 AIME 2024 + 30 AIME 2025 questions x 32 samples, "
            "31,744 new tokens; the same prompt family as the proxy, and (the seed names only the benchmark, the "
            "sample count and the cap as changes) the proxy's temperature, top-p and seed"),
    "aime24_avg12": Protocol(
        {"n_samples": 12, "seed": 20260610, "prompt_format": "opsd_eval"},
        30, "the OPSD runs' AIME24 avg@12 (seeds 003, 004): 30 AIME 2024 questions x 12 samples, sampling seed "
            "20260610; the seeds give no temperature, top-p or token cap (eval.* apply; the OPSD recipes set the "
            "released evaluator's), and the prompt is the released evaluator's (opsd_eval)"),
}


def _apply_protocol(tree: dict, overridden: dict[str, Any]) -> None:
    """Write the eval protocol's fixed values into ``tree`` (``overridden``: the ``-S`` keys and values)."""
    name = (tree.get("eval") or {}).get("protocol", EvalConfig.protocol)
    if not isinstance(name, str) or name not in PROTOCOLS:
        return  # custom, or a bad value the schema check names
    for key, value in PROTOCOLS[name].settings.items():
        dotted = f"eval.{key}"
        if dotted in overridden and overridden[dotted] != value:
            raise ConfigError(f"params key '{dotted}': eval.protocol={name} fixes it at {value!r}, but -S sets "
                              f"{overridden[dotted]!r}; another value is another measurement: use eval.protocol=custom")
        _set_dotted(tree, dotted, value)


# ----------------------------------------------------------------------------- conversion


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp`` (coercing int->float, list->tuple)."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"params key '{key}': expected a mapping (section), got {value!r}")
        return _build(tp, value, key + ".")
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"params key '{key}': expected a list of {_type_name(args[0])}, got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"params key '{key}': expected a list of {len(args)} values, got {value!r}")
        return tuple(_convert(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin in (typing.Union, types.UnionType):
        raise ConfigError(f"internal: union type at {key}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"params key '{key}': expected bool (true/false), got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"params key '{key}': expected int, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) and inf as strings
            try:
                return float(value.strip().replace(".inf", "inf"))
            except ValueError:
                pass
        raise ConfigError(f"params key '{key}': expected float, got {value!r}")
    if tp is str:
        if value is None:
            return ""
        if isinstance(value, str):
            allowed = CHOICES.get(key)
            if allowed and value not in allowed:
                raise ConfigError(f"params key '{key}': expected one of {', '.join(allowed)}; got {value!r}")
            return value
        raise ConfigError(f"params key '{key}': expected str, got {value!r}")
    raise ConfigError(f"internal: unsupported annotation {tp!r} at {key}")


def _dotted_keys(cls: type | None = None, prefix: str = "") -> list[str]:
    """Every key of the schema (``Config`` by default) as a dotted path, sections' keys included."""
    out = []
    for name, tp in typing.get_type_hints(cls or Config).items():
        out.append(prefix + name)
        if dataclasses.is_dataclass(tp):
            out += _dotted_keys(tp, f"{prefix}{name}.")
    return out


def _suggestion(name: str, known: list[str], prefix: str) -> str:
    """What an unknown key ``name`` (under ``prefix``) may have meant: a close spelling among ``known``, else the
    keys of that name in other sections (``"lr"`` under ``rollout.``: optim.lr); "" when neither."""
    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.7)
    if close:
        return f"; did you mean '{prefix}{close[0]}'?"
    elsewhere = [k for k in _dotted_keys() if k.rsplit(".", 1)[-1] == name and k != prefix + name]
    return f"; did you mean {' or '.join(repr(k) for k in elsewhere[:3])}?" if elsewhere else ""


def _build(cls: type, raw: dict, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in raw:
        if k not in names:
            raise ConfigError(f"unknown params key '{prefix}{k}'{_suggestion(str(k), list(names), prefix)} (known keys "
                              f"here: {', '.join(sorted(names))})")
    kwargs = {k: _convert(v, hints[k], prefix + k) for k, v in raw.items()}
    return cls(**kwargs)


def to_dict(cfg: Any) -> dict:
    """The config as plain YAML/JSON-able data (tuples become lists)."""

    def plain(x: Any) -> Any:
        if dataclasses.is_dataclass(x):
            return {f.name: plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        return x

    return plain(cfg)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for p in parts[:-1]:
        child = node.get(p)
        if child is None:
            child = node[p] = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"params key '{dotted}': '{p}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def _check_key_exists(dotted: str) -> None:
    cls: Any = Config
    for i, p in enumerate(dotted.split(".")):
        fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
        if p not in fields:
            where = ".".join(dotted.split(".")[:i]) or "top level"
            known = ", ".join(sorted(fields)) if fields else "(no sub-keys: it is a value)"
            hint = _suggestion(p, list(fields), "".join(q + "." for q in dotted.split(".")[:i])) if fields else ""
            raise ConfigError(f"unknown params key '{dotted}'{hint} (no '{p}' in {where}; known: {known})")
        cls = typing.get_type_hints(cls)[p]


def parse_override(text: str) -> tuple[str, Any]:
    """``"loss.name=jsd"`` -> ``("loss.name", "jsd")``; the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key=value (e.g. loss.name=jsd)")
    key, raw = text.split("=", 1)
    key = key.strip()
    _check_key_exists(key)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({yaml_problem(e)})") from None
    return key, value


def config_from_dict(raw: dict | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    tree = json.loads(json.dumps(raw or {}))  # deep copy; never mutate the caller's data
    overridden: dict[str, Any] = {}
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(tree, key, value)
        overridden[key] = value
    _apply_protocol(tree, overridden)
    return _build(Config, tree)


def yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML parse error in one line: what is wrong and where (PyYAML's own text spans several lines)."""
    mark = getattr(e, "problem_mark", None)
    if mark is None:
        return " ".join(str(e).split())
    problem = " ".join(str(getattr(e, "problem", None) or e).split())
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"


def read_yaml_mapping(path: str | Path, what: str = "params file") -> dict:
    """A YAML file whose top level is a mapping; errors name the file (in one line)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} {p} {'is a directory, not a YAML file' if p.is_dir() else 'does not exist'}")
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} {p} is not valid YAML: {yaml_problem(e)}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{what} {p}: expected a mapping at the top level")
    return raw


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read ``path`` (YAML; None = defaults only), apply ``key=value`` overrides, validate."""
    raw = read_yaml_mapping(path) if path is not None else {}
    try:
        return config_from_dict(raw, overrides)
    except ConfigError as e:
        raise ConfigError(f"{e} (in {path})" if path else str(e)) from None


def replace(cfg: Config, *overrides: str) -> Config:
    """A copy of ``cfg`` with ``key=value`` overrides applied (the original is untouched)."""
    return config_from_dict(to_dict(cfg), list(overrides))


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
