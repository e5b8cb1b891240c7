"""The decode step's Triton kernels (opdkit.engines.decode_kernels) against their torch references and
the fused static decoder with them against HF generate, through Triton's interpreter on the CPU (in a
process of its own: TRITON_INTERPRET must be set before Triton is imported). The bf16 rounding of the
kernels and their speed are checked on the GPU (tests/test_gpu.py, bench/s1_speed.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_kernels_equal_their_references_and_the_decoder_equals_generate():
    script = Path(__file__).with_name("decode_kernels_check.py")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    lines = r.stdout.splitlines()
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert sum(line.startswith("ok") for line in lines) >= 26 and not any(line.startswith("FAIL") for line in lines)
