"""Checkpoint publishing: atomic export, retries, retention, validation, locking, SIGKILL safety.

Everything here writes real files and loads them back with real HF classes (tiny Llama models
built from a config, a character-level tokenizer), no mocks except injected I/O failures.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from opdkit.persist import fsutil, publish
from opdkit.persist.checkpoints import (
    InvalidCheckpoint,
    is_valid_checkpoint,
    surviving_checkpoints_message,
    validate_checkpoint,
)
from opdkit.persist.fsutil import LockHeld, OutputLock, atomic_write_json, list_checkpoints, retry_io
from opdkit.persist.publish import Publisher, PublishError, export_checkpoint

REPO = Path(__file__).resolve().parents[1]
FAST = dict(retries=3, backoff_s=0.001)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    chars = list("0123456789+-*=() abcdefghijklmnop")[: 32 - len(specials)]
    vocab = {t: i for i, t in enumerate(specials + chars)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def tiny_parts(tie: bool = False, seed: int = 0) -> dict:
    """export_checkpoint kwargs for a tiny random Llama (weights are CPU snapshots)."""
    config = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, tie_word_embeddings=tie, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    return dict(
        state_dict={k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()},
        model_config=model.config,
        tokenizer=tiny_tokenizer(),
        generation_config=GenerationConfig(pad_token_id=0, bos_token_id=1, eos_token_id=2),
    )


def export(root: Path, step: int, parts: dict, keep: int = 3, log=print, **kw) -> Path:
    return export_checkpoint(root, step, **parts, meta={"elapsed_s": 1.5}, keep=keep, log=log, **{**FAST, **kw})


def temp_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".tmp"))


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.fixture(scope="module")
def good_ckpt(tmp_path_factory) -> Path:
    return export(tmp_path_factory.mktemp("good"), 7, tiny_parts())


# --- export round trip ----------------------------------------------------------------------


@pytest.mark.parametrize("tie", [False, True])
def test_export_validates_and_loads_back_the_same_weights(tmp_path, tie):
    parts = tiny_parts(tie=tie)
    path = export(tmp_path, 10, parts)

    assert path == tmp_path / "checkpoint-10" and temp_dirs(tmp_path) == []
    validate_checkpoint(path)  # full: structure + AutoModel/AutoTokenizer load
    stored = load_file(path / "model.safetensors")  # the real safetensors reader accepts our writer
    assert ("lm_head.weight" in stored) is (not tie)  # tied copy stored once, as save_pretrained does
    model = AutoModelForCausalLM.from_pretrained(path)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, parts["state_dict"][name], rtol=0, atol=0, msg=name)
    if tie:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert AutoTokenizer.from_pretrained(path)("1+2=3")["input_ids"] == [5, 14, 6, 17, 7]  # char-level
    assert GenerationConfig.from_pretrained(path).eos_token_id == 2
    manifest = json.loads((path / "opdkit.json").read_text())
    assert manifest["step"] == 10 and manifest["format"] == 1 and manifest["elapsed_s"] == 1.5
    assert manifest["files"]["model.safetensors"]["size"] == (path / "model.safetensors").stat().st_size
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= set(manifest["files"])
    assert json.loads((path / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_export_rejects_live_parameters_before_writing(tmp_path):
    parts = tiny_parts()
    parts["state_dict"] = dict(LlamaForCausalLM(parts["model_config"]).named_parameters())  # requires_grad
    with pytest.raises(ValueError, match="snapshots"):
        export(tmp_path, 1, parts)
    assert list(tmp_path.iterdir()) == []


def test_weights_writer_round_trips_through_the_safetensors_reader(tmp_path):
    tensors = {
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "transposed": torch.randn(4, 6).t(),  # non-contiguous
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 3),
        "mask": torch.tensor([True, False, True]),
        "ids": torch.arange(7, dtype=torch.int64),
    }
    publish._write_safetensors(tmp_path / "w.safetensors", tensors)
    loaded = load_file(tmp_path / "w.safetensors")
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


def test_reexport_of_an_existing_step_replaces_it(tmp_path):
    export(tmp_path, 5, tiny_parts(seed=0))
    logs: list[str] = []
    path = export(tmp_path, 5, tiny_parts(seed=1), log=logs.append)
    assert any("replacing existing" in line for line in logs)
    torch.testing.assert_close(load_file(path / "model.safetensors")["model.norm.weight"],
                               tiny_parts(seed=1)["state_dict"]["model.norm.weight"])  # fmt: skip
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-5"]


# --- retention ------------------------------------------------------------------------------


def test_retention_keeps_the_newest_n_and_never_the_new_one(tmp_path):
    parts = tiny_parts()
    for step in (10, 20, 30, 40):
        export(tmp_path, step, parts, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-30", "checkpoint-40"]
    (tmp_path / "checkpoint-3").mkdir()  # an invalid stub older than everything kept: removed
    (tmp_path / "checkpoint-45").mkdir()  # an invalid stub among the kept: left, with a warning
    logs: list[str] = []
    export(tmp_path, 50, parts, keep=2, log=logs.append)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-40", "checkpoint-45", "checkpoint-50"]
    assert any("leaving" in line and "checkpoint-45" in line for line in logs)
    assert surviving_checkpoints_message(tmp_path) == "surviving valid checkpoints: checkpoint-40, checkpoint-50"
    assert surviving_checkpoints_message(tmp_path / "nope") == f"no valid checkpoint survives in {tmp_path / 'nope'}"


def test_stale_temp_dirs_of_dead_runs_are_cleaned_and_interrupted_swaps_restored(tmp_path, good_ckpt):
    pid = dead_pid()
    junk = tmp_path / f".tmp-checkpoint-3-{pid}"
    junk.mkdir()
    (junk / "model.safetensors").write_bytes(b"partial")
    shutil.copytree(good_ckpt, tmp_path / f".tmp-checkpoint-7-{pid}-old")  # killed mid-replacement
    live = tmp_path / f".tmp-checkpoint-9-{os.getppid()}"  # a live process's dir is left alone
    live.mkdir()
    export(tmp_path, 20, tiny_parts())
    assert temp_dirs(tmp_path) == [live.name]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint-7", "checkpoint-20"]
    validate_checkpoint(tmp_path / "checkpoint-7", full=False)


# --- I/O failures ---------------------------------------------------------------------------


def fail_writes(monkeypatch, err: int, times: int) -> list[int]:
    """Make the weights writer raise OSError(err) for its first `times` calls; returns a call log."""
    calls: list[int] = []
    real = publish._write_safetensors

    def flaky(path, tensors):
        calls.append(1)
        if len(calls) <= times:
            (path.parent / "model.safetensors").write_bytes(b"half")  # a partial file, then the error
            raise OSError(err, os.strerror(err), str(path))
        return real(path, tensors)

    monkeypatch.setattr(publish, "_write_safetensors", flaky)
    return calls


def test_transient_error_is_retried_and_leaves_no_temp_dir(tmp_path, monkeypatch):
    calls = fail_writes(monkeypatch, errno.ECOMM, times=1)
    logs: list[str] = []
    path = export(tmp_path, 1, tiny_parts(), log=logs.append)
    assert len(calls) == 2 and any("transient I/O error" in line and "retry 1/3" in line for line in logs)
    assert temp_dirs(tmp_path) == []
    validate_checkpoint(path, full=False)


def test_persistent_error_raises_from_publisher_and_leaves_no_partial_dir(tmp_path, monkeypatch):
    pub = Publisher(tmp_path, keep=3, **FAST, log=lambda line: None)
    pub.submit(10, **tiny_parts(), meta={})
    pub.wait()
    calls = fail_writes(monkeypatch, errno.ECOMM, times=99)
    pub.submit(20, **tiny_parts(), meta={})
    with pytest.raises(PublishError, match="surviving valid checkpoints: checkpoint-10") as info:
        pub.wait()
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ECOMM
    assert len(calls) == 4  # 1 attempt + 3 retries
    with pytest.raises(PublishError):
        pub.check()  # sticky: never lost
    with pytest.raises(PublishError):
        pub.submit(30, **tiny_parts(), meta={})
    with pytest.raises(PublishError):
        pub.close()
    assert pub.published == [10]
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-10"]


def test_non_transient_error_is_not_retried(tmp_path, monkeypatch):
    calls = fail_writes(monkeypatch, errno.EACCES, times=99)
    with pytest.raises(PermissionError):
        export(tmp_path, 1, tiny_parts())
    assert len(calls) == 1 and list(tmp_path.iterdir()) == []


def test_retry_io_backoff_and_give_up(monkeypatch):
    sleeps: list[float] = []
    monkeypatch.setattr(fsutil.time, "sleep", sleeps.append)

    def always_estale():
        raise OSError(errno.ESTALE, "Stale file handle")

    with pytest.raises(OSError) as info:
        retry_io(always_estale, retries=3, backoff_s=0.5, what="testing", log=lambda line: None)
    assert sleeps == [0.5, 1.0, 2.0] and "after 4 attempts" in info.value.__notes__[0]
    assert retry_io(lambda: 42, retries=0, backoff_s=1, what="x") == 42


def test_publisher_inline_and_background_publish_in_order(tmp_path):
    for background in (False, True):
        root = tmp_path / str(background)
        with Publisher(root, keep=2, **FAST, background=background, log=lambda line: None) as pub:
            for step in (1, 2, 3):
                pub.submit(step, **tiny_parts(), meta={"background": background})
        assert pub.published == [1, 2, 3]
        assert [p.name for p in list_checkpoints(root)] == ["checkpoint-2", "checkpoint-3"]


def test_atomic_write_json(tmp_path):
    atomic_write_json(tmp_path / "a.json", {"b": 1})
    atomic_write_json(tmp_path / "a.json", {"b": 2})
    assert json.loads((tmp_path / "a.json").read_text()) == {"b": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


# --- validation -----------------------------------------------------------------------------


def _rewrite_weights(path: Path, change) -> None:
    tensors = load_file(path / "model.safetensors")
    change(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    (path / "opdkit.json").unlink()  # so the tensor check, not the recorded size, catches it


STUBS = {
    "empty dir": (lambda p: [shutil.rmtree(p), p.mkdir()], "config.json is missing"),
    "config only": (
        lambda p: [f.unlink() for f in p.iterdir() if f.name != "config.json"],
        "no model weights",
    ),
    "zero-byte weights": (lambda p: (p / "model.safetensors").write_bytes(b""), "is 0 bytes"),
    "truncated weights": (
        lambda p: os.truncate(p / "model.safetensors", (p / "model.safetensors").stat().st_size - 64),
        "model.safetensors is",
    ),
    "pruned tensor": (
        lambda p: _rewrite_weights(p, lambda t: t.pop("model.layers.0.mlp.down_proj.weight")),
        r"tensor model.layers.0.mlp.down_proj.weight \[16, 32\] that LlamaForCausalLM expects is missing",
    ),
    "wrong shape": (
        lambda p: _rewrite_weights(p, lambda t: t.update({"model.norm.weight": torch.ones(8)})),
        r"tensor model.norm.weight has shape \[8\]; LlamaForCausalLM expects \[16\]",
    ),
    "unexpected tensor": (
        lambda p: _rewrite_weights(p, lambda t: t.update({"model.extra.weight": torch.ones(2)})),
        "unexpected tensor model.extra.weight",
    ),
    "pruned, manifest kept": (
        lambda p: save_file({k: v for k, v in load_file(p / "model.safetensors").items() if "norm" not in k},
                            p / "model.safetensors"),  # fmt: skip
        "opdkit.json records",
    ),
    "no tokenizer": (lambda p: [(p / "tokenizer.json").unlink(), (p / "opdkit.json").unlink()], "tokenizer files"),
    "missing": (lambda p: shutil.rmtree(p), "does not exist"),
}


@pytest.mark.parametrize("kind", list(STUBS))
def test_validation_rejects_stubs_with_a_reason(tmp_path, good_ckpt, kind):
    path = tmp_path / "checkpoint-7"
    shutil.copytree(good_ckpt, path)
    damage, reason = STUBS[kind]
    damage(path)
    with pytest.raises(InvalidCheckpoint, match=reason):
        validate_checkpoint(path, full=False)  # the cheap checks alone catch every stub
    ok, why = is_valid_checkpoint(path)
    assert not ok and why


def test_validation_check_hashes_catches_same_size_corruption(tmp_path, good_ckpt):
    path = shutil.copytree(good_ckpt, tmp_path / "c")
    data = bytearray((path / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (path / "model.safetensors").write_bytes(bytes(data))
    validate_checkpoint(path, full=False)
    with pytest.raises(InvalidCheckpoint, match="sha256"):
        validate_checkpoint(path, full=False, check_hashes=True)


def test_sharded_weights_validate_and_a_missing_shard_is_rejected(tmp_path, good_ckpt):
    path = shutil.copytree(good_ckpt, tmp_path / "c")
    tensors = load_file(path / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:5], "model-00002-of-00002.safetensors": names[5:]}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, path / shard, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    (path / "model.safetensors").unlink()
    (path / "opdkit.json").unlink()
    validate_checkpoint(path)  # full load through the index
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(InvalidCheckpoint, match="shard model-00002-of-00002.safetensors .* is missing"):
        validate_checkpoint(path, full=False)


# --- locking --------------------------------------------------------------------------------


def test_output_lock_held_by_another_process(tmp_path):
    out = tmp_path / "out"
    code = (
        "import sys, time; from opdkit.persist.fsutil import OutputLock; "
        "OutputLock(sys.argv[1]).acquire(); print('locked', flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(LockHeld, match=f"pid={holder.pid}") as info:
            OutputLock(out).acquire()
        assert str(out) in str(info.value)
        assert [p.name for p in out.iterdir()] == [".opdkit.lock"]
    finally:
        holder.kill()
        holder.wait()
    with OutputLock(out):  # the lock dies with its holder
        with pytest.raises(LockHeld):
            OutputLock(out).acquire()  # a second lock in the same process is refused too
    with OutputLock(out):
        pass


# --- SIGKILL at random moments --------------------------------------------------------------

EXPORT_LOOP = """
import sys
sys.path.insert(0, {tests!r})
from test_publish import tiny_parts
from opdkit.persist.publish import export_checkpoint
parts = tiny_parts(tie=True)
for step in range(1, 10_000):
    export_checkpoint(sys.argv[1], step, **parts, meta={{}}, keep=2, retries=0, backoff_s=0, log=lambda m: None)
    if step == 1:
        print("ready", flush=True)
"""


def test_sigkill_at_random_moments_leaves_only_valid_checkpoints(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(EXPORT_LOOP.format(tests=str(Path(__file__).parent)))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    roots = [tmp_path / f"run{i}" for i in range(3)]
    procs = [subprocess.Popen([sys.executable, str(script), str(r)], stdout=subprocess.PIPE, text=True, env=env)
             for r in roots]  # fmt: skip
    rng = random.Random(0)
    try:
        for proc in procs:
            assert proc.stdout.readline().strip() == "ready"
            time.sleep(rng.uniform(0.0, 0.4))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for root in roots:
        ckpts = list_checkpoints(root)
        assert ckpts, f"nothing published in {root}"
        for path in ckpts:
            validate_checkpoint(path)  # every checkpoint-* that exists is complete and loads
        last = max(int(p.name.split("-")[1]) for p in ckpts)
        export(root, last + 1, tiny_parts(tie=True), keep=2, log=lambda line: None)
        assert temp_dirs(root) == [] and len(list_checkpoints(root)) == 2


def test_the_weights_are_hashed_while_written_and_check_hashes_verifies_them(tmp_path, monkeypatch):
    """The weights' record is the chunked sha256 of the file as it lies on disk (a read-back computes the same),
    over several chunks; a changed byte is caught by validate_checkpoint(check_hashes=True)."""
    import hashlib

    from opdkit.persist import weights_io
    monkeypatch.setattr(weights_io, "HASH_CHUNK", 1024)  # the tiny model's weights span many chunks
    final = export(tmp_path / "ckpts", 1, tiny_parts(), log=lambda s: None)
    record = json.loads((final / "opdkit.json").read_text())["files"]["model.safetensors"]
    data = (final / "model.safetensors").read_bytes()
    chunks = [hashlib.sha256(data[i:i + 1024]).digest() for i in range(0, len(data), 1024)]
    assert len(chunks) > 10
    assert record == {"size": len(data), "chunked_sha256": hashlib.sha256(b"".join(chunks)).hexdigest()}
    validate_checkpoint(final, full=False, check_hashes=True)
    with open(final / "model.safetensors", "r+b") as f:  # one byte of a weight changed, the size kept
        f.seek(len(data) - 3)
        f.write(bytes([data[-3] ^ 1]))
    with pytest.raises(InvalidCheckpoint, match="model.safetensors does not match the sha256"):
        validate_checkpoint(final, full=False, check_hashes=True)
