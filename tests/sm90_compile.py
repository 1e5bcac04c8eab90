"""Run a script that compiles Triton kernels for sm_90 on the CPU (Triton's own ptxas, no GPU) and hand back what it
printed: CI never sees a GPU, and the interpreter accepts what the real compile may not."""
import os
import subprocess
import sys
from pathlib import Path

import pytest


def sm90_compile_output(script: str) -> str:
    """The script's stdout, run from the repository root without TRITON_INTERPRET; the test is skipped where this
    Triton has no CUDA backend, and fails with the script's stderr if it fails otherwise."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).parents[1])
    if done.returncode and ("ptxas" in done.stderr or "backend" in done.stderr.lower()):
        pytest.skip(f"no CUDA backend in this Triton: {done.stderr[-200:]}")
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout
