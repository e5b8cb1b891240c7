"""``opdkit embedded --rebuild`` on a tiny config: deterministic files, built in a child interpreter whose
CPU kernels are held to the instruction set the shipped manifest records, and a manifest that records the
torch build, that capability and the settings that pinned it."""

from __future__ import annotations

import json
import platform

import torch

from opdkit.cli import main
from opdkit.embedded import file_hashes

TINY = ["embedded.n_train=64", "embedded.n_eval=8", "embedded.hidden_size=16", "embedded.layers=1",
        "embedded.heads=2", "embedded.intermediate_size=32", "embedded.batch_size=8", "embedded.warmup_steps=1",
        "embedded.teacher_steps=3", "embedded.student_base_steps=1", "embedded.student_carry_steps=2",
        "embedded.threads=1", "embedded.student_init=teacher_run", "embedded.student_hidden_size=0",
        "embedded.student_layers=0", "embedded.student_heads=0", "embedded.student_intermediate_size=0"]


def test_rebuild_is_deterministic_and_records_its_environment(tmp_path):
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:  # the build sets both process-wide (its reproducibility); the other tests get them back
        for name in ("a", "b"):
            argv = ["embedded", "--rebuild", "--out", str(tmp_path / name), "-p", "none", "--quiet"]
            assert main([*argv, *sum((["-S", s] for s in TINY), [])]) == 0
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
    a, b = (json.loads((tmp_path / n / "manifest.json").read_text()) for n in ("a", "b"))
    assert a["files"] == b["files"] == file_hashes(tmp_path / "a") and "student/model.safetensors" in a["files"]
    env = a["made"]["environment"]
    from opdkit.embedded.build import PINNED, shipped_capability

    shipped = shipped_capability()
    assert shipped == "AVX2"  # the shipped models' (AMD EPYC, AVX2), whatever this machine has
    assert env["torch"] == torch.__version__ and env["cpu_capability"] == shipped and env["pinned"] == PINNED[shipped]
    assert env["threads"] == 1 and env["python"] == platform.python_version()


def _build(out, *sets) -> int:
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        argv = ["embedded", "--rebuild", "--out", str(out), "-p", "none", "--quiet"]
        return main([*argv, *sum((["-S", s] for s in [*TINY, *sets]), [])])
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def test_a_smaller_student_from_scratch_has_the_shape_asked_for_and_the_teacher_keeps_its_own(tmp_path):
    sets = ["embedded.student_init=scratch", "embedded.student_hidden_size=8", "embedded.student_layers=2",
            "embedded.student_heads=1", "embedded.student_intermediate_size=24", "embedded.student_base_steps=2"]
    assert _build(tmp_path / "e", *sets) == 0
    s, t = (json.loads((tmp_path / "e" / m / "config.json").read_text()) for m in ("student", "teacher"))
    assert (s["hidden_size"], s["num_hidden_layers"], s["num_attention_heads"], s["intermediate_size"]) == (8, 2, 1, 24)
    shape = (t["hidden_size"], t["num_hidden_layers"], t["num_attention_heads"], t["intermediate_size"])
    assert shape == (16, 1, 2, 32)
    assert s["vocab_size"] == t["vocab_size"]  # one tokenizer: the losses compare the same ids
    made = json.loads((tmp_path / "e" / "manifest.json").read_text())["made"]
    assert "from scratch for 2 supervised steps" in made["student"] and "planted" in made["student"]


def test_a_build_that_cannot_be_made_is_refused_before_anything_is_written(tmp_path, capsys):
    assert _build(tmp_path / "e", "embedded.student_init=teacher_run", "embedded.student_hidden_size=8") == 2
    assert "student_init=scratch" in capsys.readouterr().err and not (tmp_path / "e").exists()
    assert _build(tmp_path / "f", "embedded.student_init=scratch", "embedded.student_hidden_size=10",
                  "embedded.student_heads=3") == 2
    assert "not a multiple of its heads" in capsys.readouterr().err and not (tmp_path / "f").exists()
