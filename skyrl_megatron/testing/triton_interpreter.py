"""Run a script with Triton's interpreter: GPU kernels' own code on CPU tensors, for the CPU suite.

Triton reads `TRITON_INTERPRET` once, when it is imported, so the script runs in a fresh Python process
(the test process, and `run_on_ranks`' rank server, have imported Triton already).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping


def run_under_triton_interpreter(script: str, *, timeout: float, env: Mapping[str, str] | None = None
                                 ) -> subprocess.CompletedProcess:
    """`python -c script` with `TRITON_INTERPRET=1` (and `env`) added to this process's environment;
    its output captured as text."""
    environment = {**os.environ, "TRITON_INTERPRET": "1", **(env or {})}
    return subprocess.run([sys.executable, "-c", script], env=environment, capture_output=True, text=True,
                          timeout=timeout)


def last_word_under_triton_interpreter(script: str, *, timeout: float, env: Mapping[str, str] | None = None) -> str:
    """The last word `script` prints under Triton's interpreter (its checks' summary), after asserting that it
    exited cleanly (the assertion carries the end of its stderr)."""
    done = run_under_triton_interpreter(script, timeout=timeout, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout.split()[-1]
