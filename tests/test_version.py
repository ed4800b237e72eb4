"""The package's version is read from its installed metadata, the one pyproject.toml declares;
imported from a source tree that was never installed, it is `0+unknown`."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import tomllib
from importlib import metadata
from pathlib import Path

import agent_runs

CHECKOUT = Path(__file__).resolve().parents[1]
PYPROJECT = CHECKOUT / "pyproject.toml"


def test_version_is_the_installed_distributions() -> None:
    assert agent_runs.__version__ == metadata.version("agent_runs")


def test_version_is_the_one_pyproject_declares() -> None:
    declared = tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))["project"]["version"]
    assert agent_runs.__version__ == declared


def _sites_without_agent_runs(into: Path) -> list[Path]:
    """Copies (by symlinks) of this interpreter's site-packages directories, in sys.path order
    (a venv can reach another's through a .pth file, as CI's lowest-psycopg venv does), without
    any trace of the agent_runs install: its dist-info, its editable-install hooks, its data."""
    found = [Path(sysconfig.get_paths()["purelib"])]
    found += [Path(entry) for entry in sys.path if entry.endswith("site-packages")]
    sites = [site for site in dict.fromkeys(found) if site.is_dir()]
    copies = []
    for number, site in enumerate(sites):
        copy = into / f"site-packages-{number}"
        copy.mkdir(parents=True)
        for entry in site.iterdir():
            if entry.name.startswith(("agent_runs", "__editable__", "_editable_impl_agent_runs")):
                continue
            (copy / entry.name).symlink_to(entry)
        copies.append(copy)
    return copies


def test_a_source_tree_that_was_never_installed_imports_with_an_unknown_version(
    tmp_path: Path,
) -> None:
    # `python -S`: no site module, so no .pth file runs and no site directory is searched but
    # the ones put on sys.path here: the checkout first (as PYTHONPATH would), then the
    # dependencies. importlib.metadata finds no agent_runs distribution on that path.
    sites = [str(site) for site in _sites_without_agent_runs(tmp_path)]
    script = (
        "import sys\n"
        f"sys.path[:0] = [{str(CHECKOUT)!r}, *{sites!r}]\n"
        "from importlib import metadata\n"
        "try:\n"
        "    metadata.version('agent_runs')\n"
        "except metadata.PackageNotFoundError:\n"
        "    pass\n"
        "else:\n"
        "    raise SystemExit('agent_runs metadata is still visible')\n"
        "import agent_runs, agent_runs.aio, agent_runs.worker\n"
        f"assert agent_runs.__file__.startswith({str(CHECKOUT)!r}), agent_runs.__file__\n"
        "print(agent_runs.__version__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-I", "-S", "-c", script],
        capture_output=True,
        check=False,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0+unknown"
