"""The real-scale fixture (``opdkit fixture qwen2``), built once per test session through the CLI
and shared by test_fixture.py and test_realscale.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from procs import env

SEED = 0


def fixture_dir(tmp_path_factory) -> Path:
    """The fixture under the session's base temp directory (built by the first caller)."""
    d = tmp_path_factory.getbasetemp() / "qwen2-fixture"
    if not (d / "manifest.json").is_file():
        proc = subprocess.run([sys.executable, "-m", "opdkit", "fixture", "qwen2", "--out", str(d), "--seed", str(SEED)],
                              env=env(), text=True, capture_output=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"wrote the qwen2 fixture to {d}" in proc.stdout
    return d
