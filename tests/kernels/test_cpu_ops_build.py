"""Loading the C++ operators never waits on a build that is not needed: torch's extension builder
takes a lock file in its build folder even to find that nothing needs building, and a process
killed while it held it (a server stopped during start-up) left every later start waiting on it
forever."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import cpu_ops

REPO = Path(__file__).resolve().parents[2]


def test_a_current_build_loads_past_a_build_lock_left_behind() -> None:
    if cpu_ops.load() == "torch":
        pytest.skip("the C++ operators are not built here")
    directory = cpu_ops.build_directory()
    assert (directory / "splitfuse.stamp").read_text() == cpu_ops._stamp()
    lock = directory / "lock"
    if lock.exists():
        pytest.skip("a build is running")
    lock.touch()  # what a process killed while it held the lock leaves
    try:
        loaded = subprocess.run(
            [sys.executable, "-c", "from kernels import cpu_ops; print(cpu_ops.load())"],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        lock.unlink(missing_ok=True)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == cpu_ops.load()
