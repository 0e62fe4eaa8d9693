"""Compile Gluon kernels for sm_90 on a machine without a GPU, for tests that check their schedule.

Gluon does not run under the Triton interpreter, and under ``TRITON_INTERPRET=1`` (which this
suite's conftest sets) triton's own jit helpers do not compile: the compile runs in a subprocess
with that variable removed and ``src`` on the path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def sm90_ptx(args: list[str]) -> str:
    """The stdout of ``python *args`` (a script printing PTX) run without the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT / "src")
    run = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, timeout=600, check=False
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout
