"""The package's version is read from its installed metadata, the one pyproject.toml declares."""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

import agent_runs

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_version_is_the_installed_distributions() -> None:
    assert agent_runs.__version__ == metadata.version("agent_runs")


def test_version_is_the_one_pyproject_declares() -> None:
    declared = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]["version"]
    assert agent_runs.__version__ == declared
