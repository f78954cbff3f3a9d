"""The code base stays ruff-clean (lint and format), as the style guide asks, and runs on
the oldest Python that pyproject.toml allows."""

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _tool(name: str, *args: str) -> subprocess.CompletedProcess:
    path = shutil.which(name) or str(Path(sys.executable).with_name(name))
    if not Path(path).exists():
        pytest.fail(f"{name} is not installed: pip install -e '.[test]'")
    return subprocess.run([path, *args], cwd=REPO, capture_output=True, text=True)


def test_ruff_lint_is_clean():
    result = _tool("ruff", "check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_is_clean():
    result = _tool("ruff", "format", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_code_needs_no_newer_python_than_pyproject_allows():
    # Only one Python is installed where the tests run, so the standard-library modules,
    # members and syntax the code uses are checked statically against the oldest allowed.
    with open(REPO / "pyproject.toml", "rb") as f:
        requires = tomllib.load(f)["project"]["requires-python"]
    assert requires.startswith(">="), f"requires-python is {requires!r}, not a lower bound"
    paths = ["transformer", "data", "benchmarks", "tests", "train.py", "evaluate.py"]
    args = [
        "-q",
        "--no-tips",
        "--violations",
        "--eval-annotations",
        f"--target={requires.removeprefix('>=')}-",
    ]
    result = _tool("vermin", *args, *paths)
    assert result.returncode == 0, result.stdout + result.stderr
