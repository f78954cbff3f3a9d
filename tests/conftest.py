"""Shared fixtures: where the repository and the real Multi30k data are."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The repository checkout."""
    return Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def multi30k_dir(repo_root: Path) -> Path:
    """The raw Multi30k files ``{train,val,test2016}.{en,de,fr,cs}``, beside the checkout."""
    return repo_root.parent / "shared" / "data" / "multi30k"
