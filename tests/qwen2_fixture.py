"""The real-scale fixture (``opdkit fixture qwen2``), built once per test session through the CLI
and shared by test_fixture.py and test_realscale.py."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

from procs import env

SEED = 0


def fixture_dir(tmp_path_factory) -> Path:
    """The fixture, built by the first caller of the test session: under the base temp directory that
    all xdist workers of the session share (one build, not one per worker), under a lock."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # .../pytest-N/popen-gwK -> .../pytest-N, the session's
    d = root / "qwen2-fixture"
    with open(root / "qwen2-fixture.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another worker that builds it first: wait for it
        if not (d / "manifest.json").is_file():
            shutil.rmtree(d, ignore_errors=True)  # a build killed half-way
            proc = subprocess.run([sys.executable, "-m", "opdkit", "fixture", "qwen2", "--out", str(d), "--seed",
                                   str(SEED)], env=env(), text=True, capture_output=True, timeout=300)
            assert proc.returncode == 0, proc.stderr[-3000:]
            assert f"wrote the qwen2 fixture to {d}" in proc.stdout
    return d
