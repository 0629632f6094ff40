"""The checks of `make lint`, run by the suite so CI holds them: ruff (with flake8-async's
rules for trio code) on every Python file, and mypy --strict (setup.cfg) on the package under its installed module names."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import REPO

BIN = os.path.dirname(sys.executable)


@pytest.mark.slow
def test_ruff_finds_nothing() -> None:
    res = subprocess.run([os.path.join(BIN, "ruff"), "check", "irdma", "fs", "server", "examples", "tests", "tools"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.slow
def test_mypy_strict_finds_nothing() -> None:
    """On the installed package's module names (tools/typecheck.py): irdma.fs, irdma.server."""
    res = subprocess.run([sys.executable, os.path.join("tools", "typecheck.py")], cwd=REPO, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0 and "Success" in res.stdout, res.stdout + res.stderr
