"""``opdkit embedded --rebuild`` on a tiny config: deterministic files, and a manifest that records the
torch build and CPU capability the weights' bits depend on."""

from __future__ import annotations

import json
import platform

import torch

from opdkit.cli import main
from opdkit.embedded import file_hashes

TINY = ["embedded.n_train=64", "embedded.n_eval=8", "embedded.hidden_size=16", "embedded.layers=1",
        "embedded.heads=2", "embedded.intermediate_size=32", "embedded.batch_size=8", "embedded.warmup_steps=1",
        "embedded.teacher_steps=3", "embedded.student_base_steps=1", "embedded.student_carry_steps=2",
        "embedded.threads=1"]


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
    assert env["torch"] == torch.__version__ and env["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert env["threads"] == 1 and env["python"] == platform.python_version()
