"""``opdkit doctor``: the pre-flight checks that a teacher/student pair will work, as one table.

``diagnose(cfg)`` returns ``Finding`` lines (OK / WARN / FAIL with the fix, SKIP where a check
does not apply here or one it needs failed) and writes nothing. First the params
(``setup.check_params``) and the file-level checks ``opdkit train`` runs before it starts
(``opdkit.pairs``); then, with the models loaded as training loads them (fp32 student, teacher in
the compute dtype, both scored over the shared vocabulary), on one batch of the student's rollouts
(``doctor.n_prompts`` prompts, one sample each, at most ``doctor.max_new_tokens`` tokens, at
``rollout.temperature`` / ``rollout.top_p``):

- memory: an estimate of a training step's peak on the visible device (``opdkit.memory``);
- alignment, per engine: the sampling-time log-probs against the recomputed ones
  (``opd.alignment_report``, the check every run makes on its first batch): the HF engine here,
  vLLM where it is installed and the device is CUDA;
- self KL: the student as its own teacher through the loss path (``step.score_batch`` +
  ``step.micro_losses``) must give KL ~ 0;
- teacher repeat: the teacher scores the batch twice, identically (no dropout, no nondeterminism);
- top-K mass, for a top-K loss (topk_fkl, topk_rkl): verl's ``teacher_mass`` / ``student_mass`` /
  ``overlap_ratio`` on the batch and the mass the loss's support sets aside (WARN under 90%);
- offline pool, with ``rollout.source=offline`` (before the live checks): the pool read and checked
  against the params (``opdkit.offline``), how many passes the run makes over it, its policy;
- alignment (vllm teacher), with ``teacher.source=vllm``: the vLLM teacher (its server, or the
  colocated engine) scores the batch and its log-probs of the sampled tokens must match the HF
  teacher's (the same directory, loaded here) within the bf16 alignment tolerance
  (``runtime.alignment_tol_bf16``): a server serving another model, a checkpoint with padding rows,
  a shifted answer fail. (Every training step checks each answer's layout: ``engines.vllm_teacher``.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import textwrap

import torch

from opdkit import loss_table, offline, opd, pairs, step as opd_step
from opdkit.config import Config, ConfigError, replace
from opdkit.data import encode_prompt
from opdkit.engines import vllm as vllm_engine
from opdkit.engines.base import left_pad
from opdkit.engines.select import check_params as check_engine_params, engine_name, make_engine
from opdkit.memory import GIB, device_memory, estimate, fixed, model_shape, peak
from opdkit.models import ModelError, compute_dtype, load_model, pick_device, setup_torch
from opdkit.pairs import FAIL, OK, SKIP, WARN, Finding, Inputs
from opdkit.scoring import AlignmentError
from opdkit.setup import RunError, check_params

# + "alignment (vllm teacher)"
LIVE_CHECKS = ("memory", "alignment (hf)", "self KL", "teacher repeat", "alignment (vllm)")


def diagnose(cfg: Config, log=lambda _: None) -> list[Finding]:
    """Every check, in order (see the module docstring); ``log`` hears what is being done."""
    device = pick_device(cfg.runtime)
    findings = [params_finding(cfg, device)]
    inputs, found = pairs.check_inputs(cfg, strict=False)
    findings += found
    if cfg.rollout.source == "offline":
        findings.append(offline_finding(cfg, inputs))
    if inputs is None:
        return findings + [Finding(c, SKIP, "not run: fix the FAIL lines above first") for c in LIVE_CHECKS]
    return findings + live_checks(cfg, inputs, device, log)


def params_finding(cfg: Config, device: torch.device) -> Finding:
    try:
        check_params(cfg)
        check_engine_params(cfg, device)
    except (RunError, ConfigError) as e:
        return Finding("params", FAIL, str(e), "change the params (-p, -r, -S) as it says")
    R = cfg.rollout
    return Finding("params", OK, f"loss.name={cfg.loss.name}, teacher.source={cfg.teacher.source}, "
                   f"{R.prompts_per_step} prompts x {R.samples_per_prompt} samples x {R.max_new_tokens} new tokens "
                   "per step, "
                   f"engine {engine_name(cfg, device)} on {device}")


def autocast(device: torch.device, dtype: torch.dtype):
    """The step's autocast (``setup.Run.autocast``), as a factory."""
    if device.type == "cuda" and dtype == torch.bfloat16:
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext


def live_checks(cfg: Config, inputs: Inputs, device: torch.device, log) -> list[Finding]:
    setup_torch(cfg.runtime)
    torch.manual_seed(cfg.seed)
    dtype = compute_dtype(cfg.runtime, device)
    tok = inputs.tokenizer
    examples = inputs.examples[: cfg.doctor.n_prompts]
    prompts = [encode_prompt(ex, tok, cfg.data) for ex in examples]
    out = [memory_finding(cfg, inputs, prompts, device)]
    log(f"loading the models on {device}")
    try:
        student = load_model(inputs.student_path, device, dtype, "student model", trainable=True)
        models = {"student model": (inputs.student_path, student)}
        teacher = None
        if inputs.teacher_path is not None and has_weights(inputs.teacher_path):  # a served teacher may have none here
            teacher = load_model(inputs.teacher_path, device, dtype, "teacher model")
            if cfg.teacher.tokenizer == "own":  # over its own tokenizer's ids
                pairs.use_shared_vocab(inputs.teacher_tokenizer, {"teacher model": (inputs.teacher_path, teacher)},
                                       log=lambda _: None)
            else:
                models["teacher model"] = (inputs.teacher_path, teacher)
        pairs.use_shared_vocab(tok, models, log=lambda _: None)
    except ModelError as e:
        return out + [Finding("models", FAIL, str(e), "the directories above load as configs but not as models: "
                              "re-export them with save_pretrained")] + [
            Finding(c, SKIP, "not run: the models did not load") for c in LIVE_CHECKS[1:]]
    student.train()  # as build_run leaves it (dropout, if the model has any, is on)
    ac = autocast(device, dtype)
    cfg_hf = replace(cfg, "rollout.engine=hf")
    log(f"sampling {len(prompts)} prompts from the student (hf engine)")
    batch = sample_batch(cfg_hf, student, tok, examples, prompts, ac)
    precision = opd.check_precision(dtype, device, engine=engine_name(cfg_hf, device),
                                    static_cache=cfg_hf.rollout.static_cache)
    out.append(alignment_finding("alignment (hf)", cfg_hf, batch, student, precision, ac))
    # the student's prompts
    own = opd.Batch(batch.rollout, batch.rollout.prompt_ids_B_Sp, batch.rollout.prompt_mask_B_Sp)
    t_own = own
    if inputs.xtok is not None and cfg.teacher.tokenizer == "own":  # the teacher scores its own tokens of the samples
        from opdkit import xtok
        from opdkit.data import encode_prompt as encode

        t_own = opd.Batch(batch.rollout, batch.rollout.prompt_ids_B_Sp, batch.rollout.prompt_mask_B_Sp)
        t_own.xtok = xtok.teacher_view(inputs.xtok, batch.rollout.completion_ids_B_T, batch.rollout.completion_mask_B_T,
                                       [encode(ex, inputs.teacher_tokenizer, cfg.data) for ex in examples])
    cfg_self = cfg if loss_table.samples_from(cfg.loss) == "student" else replace(cfg, "loss.name=rkl")
    tol = opd.alignment_tolerance(precision, runtime=cfg.runtime)[1]
    log("scoring the batch: the student against itself, the teacher twice")
    out.append(self_kl_finding(cfg_self, student, own, ac, tol))
    out.append(teacher_repeat_finding(cfg_self, teacher, t_own, ac, tol))
    if TOPK_LOSSES.get(cfg.loss.name) and t_own is own:  # (cross-tokenizer pairs refuse the top-K losses)
        out.append(topk_finding(cfg, student, teacher, own, ac))
    if cfg.teacher.source == "vllm":
        out.append(vllm_teacher_finding(cfg, inputs, teacher, t_own, device, ac, log))
    out.append(vllm_finding(cfg, student, tok, examples, prompts, dtype, device, ac, log))
    return out


def sample_batch(cfg: Config, student, tok, examples, prompts, ac) -> opd.Batch:
    """One sample per prompt from ``cfg``'s engine, laid out as a training step's batch (the
    teacher's prompts: the same, or the privileged ones)."""
    n = min(cfg.doctor.max_new_tokens, cfg.rollout.max_new_tokens)
    engine = make_engine(cfg, student, tok)
    engine.sync_weights(student)
    with ac():
        ro = engine.sample(prompts, samples_per_prompt=1, seeds=opd.step_seeds(cfg.seed, 0, len(prompts)),
                           temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, max_new_tokens=n)
    if not cfg.teacher.source.startswith("privileged"):
        return opd.Batch(ro, ro.prompt_ids_B_Sp, ro.prompt_mask_B_Sp)
    priv = [encode_prompt(ex, tok, cfg.data, privileged=True) for ex in examples]
    return opd.Batch(ro, *left_pad(priv, tok.pad_token_id, ro.completion_ids_B_T.device))


def alignment_finding(check: str, cfg: Config, batch: opd.Batch, student, precision: torch.dtype, ac) -> Finding:
    tokens = int(batch.rollout.completion_mask_B_T.sum())
    try:
        with ac():
            r = opd.alignment_report(cfg.loss, batch, student, precision, rollout=cfg.rollout, runtime=cfg.runtime,
                                     teacher_source=cfg.teacher.source)
    except AlignmentError as e:
        return Finding(check, FAIL, str(e), "the loss would train on log-probs of other tokens or positions than were "
                       "sampled: fix what the message names before training")
    if "logprob_check" in r:  # data.pad_side=right: the span part only
        return Finding(check, OK, f"{tokens} sampled tokens: the supervised span is exactly the sampled completion, "
                       f"right after the prompt block; log-prob comparison {r['logprob_check']}")
    tol_max, tol_mean = opd.alignment_tolerance(precision, runtime=cfg.runtime)
    paths = "; ".join(f"{what}max {r[f'{key}_max_abs_dlogp']:.2g}, mean {r[f'{key}_mean_abs_dlogp']:.2g}, weight-0 "
                      f"share {r[f'{key}_weight0_share']:.2g}"
                      for key, what in (("recompute", ""), ("teacher_path", "on the teacher's input: "))
                      if f"{key}_max_abs_dlogp" in r)
    return Finding(check, OK, f"{tokens} sampled tokens, |sampling-time - recomputed log-prob| {paths} (allowed at "
                   f"{str(precision).replace('torch.', '')}: max {tol_max:g}, mean {tol_mean:g}; weight-0 share "
                   f"{cfg.runtime.alignment_max_weight0_share:g})")


def _step_settings(cfg: Config) -> dict:
    """The settings ``step.score_batch`` and ``step.micro_losses`` read besides ``cfg.loss`` (the
    doctor's batches: one teacher, the student's tokens)."""
    return {"rollout": cfg.rollout, "runtime": cfg.runtime, "micro_batch": cfg.optim.micro_batch}


def self_kl_finding(cfg: Config, student, batch: opd.Batch, ac, tol: float) -> Finding:
    contexts = opd_step.score_batch(cfg.loss, student, batch, ac, **_step_settings(cfg))
    m = opd_step.micro_losses(cfg.loss, student, batch, contexts, ac, **_step_settings(cfg))
    student.zero_grad(set_to_none=True)
    kl = m["kl"]
    detail = (f"the student as its own teacher through the {cfg.loss.name} loss path: KL {kl:.2g} on "
              f"{int(m['tokens'])} tokens")
    if abs(kl) <= tol:  # NaN fails too
        return Finding("self KL", OK, f"{detail} (allowed {tol:g})")
    dropout = {k: v for k, v in student.config.to_dict().items()
               if "dropout" in k and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0}
    why, fix = ((f"the student's config.json sets {', '.join(f'{k}={v}' for k, v in dropout.items())}: dropout is "
                 "on in training mode, so two passes over the same tokens differ",
                 "set those dropout probabilities to 0 (OPD compares log-probs of one policy)")
                if dropout else ("the student's and the teacher's scoring of the same tokens differ",
                                 "report it with this output: the loss would not be zero where the teacher is the "
                                 "student"))
    return Finding("self KL", FAIL, f"{detail}, expected ~0 (allowed {tol:g}): {why}", fix)


def teacher_repeat_finding(cfg: Config, teacher, batch: opd.Batch, ac, tol: float) -> Finding:
    if teacher is None:
        return Finding("teacher repeat", SKIP, f"teacher.source={cfg.teacher.source}: the teacher is the student "
                       "(self KL checks it)")
    first, second = (torch.cat([c.logp_B_T for c in opd_step.score_batch(cfg.loss, teacher, batch, ac,
                                                                         **_step_settings(cfg))])
                     for _ in range(2))
    m_B_T = batch.rollout.completion_mask_B_T.bool()
    d = float((first - second)[m_B_T].abs().max()) if m_B_T.any() else 0.0
    if d == 0.0:
        return Finding("teacher repeat", OK,
                       f"the teacher scored the batch twice identically ({int(m_B_T.sum())} tokens)")
    status = WARN if d <= tol else FAIL
    return Finding("teacher repeat", status, f"the teacher's two scorings of the same batch differ by up to {d:.2g} "
                   f"per token (allowed {tol:g}): nondeterministic kernels, dropout, or a stochastic layer",
                   "load the teacher in eval mode with deterministic kernels (torch.use_deterministic_algorithms)")


# the top-K losses and the mass their support sets aside: (the metric, what it is, the fix when it is small,
# whether loss.tail_bucket keeps that mass in the loss)
TOPK_LOSSES = {
    "topk_fkl": ("teacher_mass", "the teacher's mass on its top-K",
                 "raise loss.topk, or set loss.tail_bucket=true (the rest of the teacher's mass as one bucket)", True),
    "topk_rkl": ("student_support_mass", ("the student's mass on its own top-K (the loss renormalises over it and "
                                          "gives the rest no gradient)"), "raise loss.topk", False),
}
TOPK_MASS_WARN = 0.9  # below this share of the distribution inside the support, the doctor warns


def topk_finding(cfg: Config, student, teacher, batch: opd.Batch, ac) -> Finding:
    """A top-K loss on the doctor's batch: verl's ``teacher_mass`` / ``student_mass`` / ``overlap_ratio``
    (``opdkit.topk_losses``) and the mass the loss's support sets aside (WARN under ``TOPK_MASS_WARN``)."""
    check = "top-K mass"
    if teacher is None:
        return Finding(check, SKIP, "no teacher weights here to score the batch with")
    contexts = opd_step.score_batch(cfg.loss, teacher, batch, ac, **_step_settings(cfg))
    m = opd_step.micro_losses(cfg.loss, student, batch, contexts, ac, **_step_settings(cfg))
    student.zero_grad(set_to_none=True)
    key, what, fix, tail = TOPK_LOSSES[cfg.loss.name]
    detail = (f"loss.name={cfg.loss.name}, K={cfg.loss.topk} on {int(m['tokens'])} sampled tokens: teacher_mass "
              f"{m['teacher_mass']:.4f}, student_mass {m['student_mass']:.4f}, overlap_ratio {m['overlap_ratio']:.3f} "
              f"(verl's definitions); {what} {m[key]:.4f}")
    small = m[key] < TOPK_MASS_WARN and not (tail and cfg.loss.tail_bucket)
    return Finding(check, WARN, detail, fix) if small else Finding(check, OK, detail)


def offline_finding(cfg: Config, inputs: Inputs | None) -> Finding:
    """``rollout.source=offline``: the pool read and checked against these params (``opdkit.offline``):
    what it holds, how many passes the run makes over it, whether its policy is the run's student."""
    if inputs is None:
        return Finding("offline pool", SKIP, "not run: fix the FAIL lines above first")
    try:
        pool = offline.read_pool(cfg.rollout.offline_file)
        offline.check_pool(cfg, pool, inputs.teacher_path, inputs.data_fingerprint)
    except offline.OfflineError as e:
        return Finding("offline pool", FAIL, str(e), "draw a pool for these params: opdkit offline-rollouts --out FILE "
                       "(with the same -p / -r / -S)")
    m = pool.meta
    passes = cfg.rollout.prompts_per_step * cfg.budget.max_steps / m["n_prompts"] if cfg.budget.max_steps else None
    who = ("the run's student (at step 0)" if offline.behaviour_is_student(pool, inputs.student_path)
           else "another model than the run's student")
    return Finding("offline pool", OK, f"{pool.path}: {m['n_prompts']} prompts x {m['samples_per_prompt']} samples of "
                   f"{m['policy']} ({who}), scored by {m['teacher']}"
                   + (f", teacher top-{m['topk']}" if m["topk"] else "")
                   + (f"; budget.max_steps makes {passes:.2g} passes over it" if passes else "")
                   + f"; importance ratio: rollout.offline_ratio={cfg.rollout.offline_ratio}")


def has_weights(path) -> bool:
    from opdkit.models import WEIGHT_FILES

    return any((path / f).is_file() for f in WEIGHT_FILES)


def vllm_teacher_finding(cfg: Config, inputs: Inputs, teacher, batch: opd.Batch, device, ac, log) -> Finding:
    check = "alignment (vllm teacher)"
    if cfg.teachers:
        return Finding(check, SKIP, "several teachers: run the doctor on each (its path as teacher.path, its url as "
                       "teacher.url)")
    if teacher is None:
        return Finding(check, SKIP, f"{inputs.teacher_path} holds no weights to compare the served teacher with")
    from opdkit.engines import vllm_teacher

    log(f"scoring the batch with the vLLM teacher ({cfg.teacher.url or 'colocated engine'})")
    try:
        scorer = vllm_teacher.make_teachers(cfg, inputs, device, log)
        got = torch.cat([c.logp_B_T for c in opd_step.score_batch(cfg.loss, scorer, batch, ac, **_step_settings(cfg))])
    except (vllm_teacher.VLLMTeacherError, ImportError, RuntimeError, ValueError) as e:
        return Finding(check, FAIL, f"the vLLM teacher could not score the batch: {type(e).__name__}: {e}",
                       "start the server (vllm serve DIR --max-logprobs K) or install vLLM; see the message")
    want = torch.cat([c.logp_B_T for c in opd_step.score_batch(cfg.loss, teacher, batch, ac, **_step_settings(cfg))])
    m_B_T = batch.rollout.completion_mask_B_T.bool()
    d_N = (got.to(want.device) - want)[m_B_T].abs()
    d_max, d_mean = (float(d_N.max()), float(d_N.mean())) if d_N.numel() else (0.0, 0.0)
    tol_max, tol_mean = cfg.runtime.alignment_tol_bf16
    detail = (f"{int(m_B_T.sum())} sampled tokens, |vLLM teacher - HF teacher log-prob| max {d_max:.2g}, mean "
              f"{d_mean:.2g} (allowed at bf16: max {tol_max:g}, mean {tol_mean:g})")
    if d_max <= tol_max and d_mean <= tol_mean:
        return Finding(check, OK, detail)
    return Finding(check, FAIL, detail, f"the vLLM teacher is not the HF teacher of {inputs.teacher_path}: serve that "
                   "checkpoint (cut to the tokenizer's ids: opdkit vocab-cut), or fix teacher.url")


def vllm_finding(cfg: Config, student, tok, examples, prompts, dtype, device, ac, log) -> Finding:
    if not vllm_engine.available():
        return Finding("alignment (vllm)", SKIP, "vLLM is not installed here (pip install 'opdkit[vllm]'); training "
                       "here samples with the HF engine, checked above")
    if device.type != "cuda":
        return Finding("alignment (vllm)", SKIP, f"vLLM samples on CUDA; this device is {device.type}")
    cfg_v = replace(cfg, "rollout.engine=vllm")
    log(f"sampling {len(prompts)} prompts from the student (vllm engine)")
    batch = sample_batch(cfg_v, student, tok, examples, prompts, ac)
    precision = opd.check_precision(dtype, device, engine=engine_name(cfg_v, device),
                                    static_cache=cfg_v.rollout.static_cache)
    return alignment_finding("alignment (vllm)", cfg_v, batch, student, precision, ac)


def memory_finding(cfg: Config, inputs: Inputs, prompts: list[list[int]], device: torch.device) -> Finding:
    """The estimate for a step whose prompts are as long as the longest of ``prompts``."""
    prompt_tokens = max(map(len, prompts))
    student = model_shape(inputs.student_path, cfg.lora)
    teacher = [model_shape(p) for p in inputs.teacher_paths.values()] or None
    total, free = device_memory(device)
    parts = estimate(cfg, student, teacher, prompt_tokens, device, engine_name(cfg, device), total)
    need = peak(parts)
    phases = {phase: f"{phase} {_size(sum(items.values()))} ({', '.join(f'{k} {_size(v)}' for k, v in items.items())})"
              for phase, items in parts.items() if items}
    larger = " and ".join(phases[p] for p in ("rollout", "update", "score") if p in phases)
    detail = (f"estimate {_size(need)} at a step's peak, of {_size(total)} {'GPU' if device.type == 'cuda' else 'RAM'} "
              f"({_size(free)} free) on {device}, one process, for the longest prompt of the {len(prompts)} checked "
              f"({prompt_tokens} tokens): {phases['held']} + the larger of {larger}. An estimate: allocator "
              "overhead and kernel workspaces are not counted")
    if fixed(parts) > total:
        return Finding("memory", FAIL, detail, "the weights, gradients and AdamW moments alone do not fit: "
                       "-S lora.enabled=true, a smaller student, or torchrun with FSDP2 (divides them by the world "
                       "size)")
    if need > free:
        return Finding("memory", WARN, detail, "-S runtime.grad_checkpointing=true, a smaller optim.micro_batch or "
                       "runtime.logprob_chunk, fewer rollout.batch_size rows per decode call")
    return Finding("memory", OK, detail)


def _size(n: int) -> str:
    """Bytes as GiB / MiB / KiB, three significant digits."""
    for unit, scale in (("GiB", GIB), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n / 2**10:.3g} KiB"


def format_table(findings: list[Finding], width: int = 110) -> str:
    """The findings as aligned lines, long details wrapped, each fix on its own line."""
    col = max(len(f.check) for f in findings)
    lines = []
    for f in findings:
        head = f"{f.status:<4}  {f.check:<{col}}  "
        wrap = dict(width=width, subsequent_indent=" " * len(head), break_long_words=False, break_on_hyphens=False)
        lines.append(textwrap.fill(f.detail, initial_indent=head, **wrap))  # paths stay whole
        if f.fix:
            lines.append(textwrap.fill(f.fix, initial_indent=" " * (len(head) - 2) + "> fix: ", **wrap))
    counts = {s: sum(f.status == s for f in findings) for s in (OK, WARN, FAIL, SKIP)}
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items() if n) +
                 (": the pair is ready" if not counts[FAIL] else ": fix each FAIL before training"))
    return "\n".join(lines)


def with_pair(cfg: Config, student: str | None, teacher: str | None, data: str | None) -> Config:
    """``cfg`` with the doctor's --student / --teacher / --data paths (a new config)."""
    cfg = dataclasses.replace(cfg, student=dataclasses.replace(cfg.student, path=student)) if student else cfg
    cfg = dataclasses.replace(cfg, teacher=dataclasses.replace(cfg.teacher, path=teacher)) if teacher else cfg
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, train=data)) if data else cfg
