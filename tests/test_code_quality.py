"""The code as the project holds it: ruff clean (E501 on, at the line length pyproject.toml
sets) and type-checked by mypy over inflight/, as part of the one test command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_ruff_finds_nothing() -> None:
    run = _run("ruff", "check", "--output-format", "concise", ".")
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]


def test_mypy_finds_nothing() -> None:
    run = _run("mypy")  # files and options from pyproject.toml
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "Success" in run.stdout
