"""The suite collects however it is started: ``python -m pytest`` (the Makefile's way) puts the
working directory on sys.path, the ``pytest`` script does not, and then the folder tests/kernels/
used to shadow the ``kernels`` package."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_the_pytest_script_collects_from_another_directory(tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "pytest"
    if not script.exists():
        found = shutil.which("pytest")
        if found is None:
            pytest.skip("no pytest script next to this interpreter")
        script = Path(found)
    target = REPO / "tests" / "unit" / "test_tensor_parallel_sharding.py"
    result = subprocess.run(
        [str(script), "--collect-only", "-q", "-p", "no:cacheprovider", str(target)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "error" not in result.stdout.lower()
