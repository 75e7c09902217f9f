"""The code as the project holds it: ruff clean (E501 on, at the line length pyproject.toml
sets), type-checked by mypy over inflight/, and within the import contracts of pyproject.toml,
as part of the one test command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from inflight.model.loader import cache_dir

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    # mypy's incremental cache lives with inflight's other caches, not in the clone: a fresh
    # clone re-checks only what changed (mypy validates a cached module by its content's hash).
    env = {"MYPY_CACHE_DIR": str(cache_dir() / "mypy"), **os.environ}
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env=env)


def test_ruff_finds_nothing() -> None:
    run = _run("ruff", "check", "--output-format", "concise", ".")
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]


def test_mypy_finds_nothing() -> None:
    run = _run("mypy")  # files and options from pyproject.toml
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "Success" in run.stdout


def test_imports_keep_the_layers_contract() -> None:
    """The layers, independence and torch-free contracts of pyproject.toml (docs/architecture.md)."""
    lint = Path(sys.executable).with_name("lint-imports")
    run = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "0 broken" in run.stdout
