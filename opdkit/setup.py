"""Everything a run needs before its first step, checked before anything is written.

``prepare_inputs`` validates params, then paths, data and the pair (``opdkit.pairs``, the checks
``opdkit doctor`` runs too), so a bad input fails with one clear line and leaves the output
directory untouched; ``build_run`` loads models, wraps LoRA, makes the optimizer and the teacher
source.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from opdkit import loss_table, offline, pairs, rewards, teachers
from opdkit.config import Config
from opdkit.data import Example, encode_prompt
from opdkit.engines import vllm_teacher
from opdkit.models import compute_dtype, enable_checkpointing, load_model, pick_device, setup_torch
from opdkit.pairs import Inputs, use_shared_vocab
from opdkit.sharding import reshard


class RunError(ValueError):
    """A run that cannot start (bad params combination); the message says what to change."""


def check_params(cfg: Config) -> None:
    b, o = cfg.budget, cfg.optim
    if b.max_steps <= 0 and b.max_wall_time_s <= 0:
        raise RunError("no budget: set budget.max_steps > 0 or budget.max_wall_time_s > 0")
    if o.schedule in ("linear", "cosine") and (b.schedule_steps or b.max_steps) <= 0:
        raise RunError(f"optim.schedule={o.schedule} needs a step horizon: set budget.max_steps or "
                       "budget.schedule_steps (or use optim.schedule=wallclock_cosine)")
    if o.schedule == "wallclock_cosine" and b.max_wall_time_s <= 0:
        raise RunError("optim.schedule=wallclock_cosine needs budget.max_wall_time_s > 0")
    if b.max_wall_time_s > 0 and b.deadline_reserve_s >= b.max_wall_time_s:
        raise RunError(f"budget.deadline_reserve_s ({b.deadline_reserve_s}) must be below budget.max_wall_time_s "
                       f"({b.max_wall_time_s})")
    if cfg.rollout.overlap and loss_table.samples_from(cfg.loss) != "student":
        raise RunError("rollout.overlap=1 draws the student's next batch ahead; loss.name=sft does not sample the "
                       "student: set rollout.overlap=0")
    if cfg.teacher.source != "model" and loss_table.samples_from(cfg.loss) != "student":
        raise RunError("loss.name=sft is the supervised control; it uses teacher.source=model "
                       "(or sft_source=reference)")
    if cfg.data.pad_side == "right" and cfg.runtime.unpadded_rows:
        raise RunError("data.pad_side=right scores the padded layout itself (pads between prompt and completion, "
                       "consuming positions); runtime.unpadded_rows=true would remove those pads: set it to false")
    if cfg.loss.teacher_temperature != 1.0 and loss_table.spec(cfg.loss.name).teacher != "full":
        raise RunError(f"loss.teacher_temperature applies to the full-distribution losses (fkl, rkl, jsd); loss.name="
                       f"{cfg.loss.name} scores sampled tokens: leave loss.teacher_temperature at 1")
    for why in (rewards.check_params(cfg), teachers.check_params(cfg), vllm_teacher.check_params(cfg),
                offline.refusal(cfg)):
        if why:
            raise RunError(why)
    if cfg.teacher.tokenizer == "own":  # cross-tokenizer OPD (imported only then: a shared run never loads it)
        from opdkit import xtok_loss

        if why := xtok_loss.check_params(cfg):
            raise RunError(why)
    try:
        teachers.pick_device(cfg.teacher.device, torch.device("cpu"))  # is that device on this machine?
    except ValueError as e:
        raise RunError(str(e)) from None


def prepare_inputs(cfg: Config) -> Inputs:
    """Validate every input without touching the output directory (the first failure raises)."""
    check_params(cfg)
    inputs, _ = pairs.check_inputs(cfg, strict=True)
    if cfg.rollout.source == "offline":  # the pool read and checked; the examples are its prompts (opdkit.offline)
        try:
            inputs = offline.pool_inputs(cfg, inputs)
        except offline.OfflineError as e:
            raise RunError(str(e)) from None
    return inputs


def code_revision() -> str:
    """git revision of the opdkit source (with '+dirty'), else a hash of its files."""
    root = Path(__file__).resolve().parent
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if rev.returncode == 0:
            dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--", "."], capture_output=True,
                                   text=True, timeout=10).stdout.strip()
            return rev.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        pass
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(f.read_bytes())
    return "src-" + h.hexdigest()[:16]


@dataclass
class Run:
    cfg: Config
    inputs: Inputs
    device: torch.device
    dtype: torch.dtype
    student: torch.nn.Module
    tokenizer: object
    teacher: torch.nn.Module
    optimizer: torch.optim.Optimizer
    teacher_ctx: object = contextlib.nullcontext  # context manager the teacher runs under
    ema: torch.nn.Module | None = None
    code_revision: str = ""  # the kit's git revision, in each checkpoint's meta
    run_id: str | None = None  # this run's id (rundir.Start), kept across resumes
    lr_clock_start_s: float | None = None  # wall seconds at which the wall-clock schedule started (None: not yet)
    publish_dtype: torch.dtype | None = None  # the dtype checkpoints are published in (publish.dtype)
    xtok: object = None  # teacher.tokenizer=own: the tokenizer pair (opdkit.xtok.Pair), else None

    def autocast(self):
        if self.device.type == "cuda" and self.dtype == torch.bfloat16:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def prompts(self, examples: list[Example], privileged: bool = False) -> list[list[int]]:
        return [encode_prompt(ex, self.tokenizer, self.cfg.data, privileged=privileged) for ex in examples]

    def teacher_prompts(self, examples: list[Example]) -> list[list[int]]:
        """teacher.tokenizer=own: each row's prompt rendered and tokenized by the teacher's tokenizer (and
        chat template)."""
        return [encode_prompt(ex, self.inputs.teacher_tokenizer, self.cfg.data) for ex in examples]

    def teacher_rows(self, examples: list[Example], samples_per_prompt: int) -> torch.Tensor | None:
        """Several teachers: each row's teacher (its index in ``cfg.teachers``), prompt-major; else None."""
        if not self.cfg.teachers:
            return None
        index = {t.name: i for i, t in enumerate(self.cfg.teachers)}
        return torch.tensor([index[ex.teacher] for ex in examples for _ in range(samples_per_prompt)],
                            device=self.device)


def _wrap_lora(cfg: Config, model):
    from peft import LoraConfig, get_peft_model

    lc = cfg.lora
    return get_peft_model(model, LoraConfig(r=lc.r, lora_alpha=lc.alpha, lora_dropout=lc.dropout,
                                            target_modules=list(lc.target_modules), task_type="CAUSAL_LM"))


def build_run(cfg: Config, inputs: Inputs, log=print) -> Run:
    setup_torch(cfg.runtime)
    torch.manual_seed(cfg.seed)
    device = pick_device(cfg.runtime)
    dtype = compute_dtype(cfg.runtime, device)
    tok = inputs.tokenizer
    student = load_model(inputs.student_path, device, dtype, "student model", trainable=True)
    vocab_models = {"student model": (inputs.student_path, student)}
    use_shared_vocab(tok, vocab_models, log=lambda _: None)  # before LoRA and any copy of the student
    if cfg.runtime.grad_checkpointing:  # every training forward passes use_cache=False itself: the config
        enable_checkpointing(student, cfg.runtime.checkpoint_keep_attention)  # (published with each checkpoint)
        # stays the source student's
    if cfg.lora.enabled:
        student = _wrap_lora(cfg, student)
    student.train()

    src, ema, ctx = cfg.teacher.source, None, contextlib.nullcontext
    own = cfg.teacher.tokenizer == "own"  # cross-tokenizer: the teacher scores over its own tokenizer's ids
    t_vocab_models = {}
    if cfg.rollout.source == "offline":  # the pool's stored scores stand in for the teacher: no teacher model here
        teacher = inputs.offline.serve(cfg, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    elif src == "model":  # one teacher, or several (a TeacherSet), on teacher.device ("": the student's)
        t_device = teachers.pick_device(cfg.teacher.device, device)
        members = [load_model(path, t_device, compute_dtype(cfg.runtime, t_device), what)
                   for what, path in inputs.teacher_paths.items()]
        (t_vocab_models if own else vocab_models).update(
            {what: (path, m) for (what, path), m in zip(inputs.teacher_paths.items(), members)})
        teacher = teachers.TeacherSet(tuple(t.name for t in cfg.teachers), members) if cfg.teachers else members[0]
    elif src == "vllm":  # scores in vLLM (its own process, or a server): nothing of it in this process
        teacher = vllm_teacher.make_teachers(cfg, inputs, device, log)
    elif src == "privileged_fixed" and cfg.lora.enabled:
        teacher, ctx = student, student.disable_adapter  # the frozen base is the initial student
    elif src in ("privileged_fixed", "privileged_ema"):
        teacher = copy.deepcopy(student).eval().requires_grad_(False)
        ema = teacher if src == "privileged_ema" else None
    else:  # privileged_live: the current student itself (adapters on with LoRA), under no_grad
        teacher = student

    use_shared_vocab(tok, vocab_models, log)  # checks the teacher's rows too, and says what was done
    if t_vocab_models:
        use_shared_vocab(inputs.teacher_tokenizer, t_vocab_models, log)
    opt = make_optimizer(cfg, student, device)
    n_train = sum(p.numel() for p in student.parameters() if p.requires_grad)
    where = (f" on {teachers.device_of(teacher)}" if isinstance(teacher, torch.nn.Module) and teacher is not student
             else "")
    log(f"student {inputs.student_path} ({n_train:,} trainable parameters, {device}, compute {dtype}); "
        f"teacher {', '.join(map(str, inputs.teacher_paths.values())) or src}{where}"
        + (f" (teacher.source=vllm{', ' + cfg.teacher.url if cfg.teacher.url else ', colocated'})"
           if src == "vllm" else ""))
    return Run(cfg, inputs, device, dtype, student, tok, teacher, opt, ctx, ema, xtok=inputs.xtok if own else None)


def make_optimizer(cfg: Config, student, device: torch.device) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters, in ``parameters()`` order (the trainer state keys
    optimizer entries by that order)."""
    o = cfg.optim
    return torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=o.lr, betas=o.betas,
                             weight_decay=o.weight_decay, fused=device.type == "cuda")


@torch.no_grad()
def update_ema(ema: torch.nn.Module, student: torch.nn.Module, decay: float) -> None:
    for m in (ema, student):  # FSDP2 (torchrun): pair the two models' shards, not gathered copies
        reshard(m)
    for pe, ps in zip(ema.parameters(), student.parameters()):
        pe.mul_(decay).add_(ps.detach(), alpha=1 - decay)


def load_trainable_state(student, state: dict) -> None:
    if hasattr(student, "merge_adapter"):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(student, state)
    else:
        student.load_state_dict(state)
