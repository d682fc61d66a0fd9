"""ruff, configured in pyproject.toml (`[tool.ruff]`), reports nothing on the repository: the package, the tests,
the benchmarks and the examples."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ruff() -> list[str]:
    """The ruff of this environment (the `test` extra installs it), else one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "ruff")
    found = here if os.path.exists(here) else shutil.which("ruff")
    if found is None:
        pytest.fail("ruff is not installed: `pip install -e '.[test]'` installs it")
    return [found]


def test_ruff_reports_nothing():
    done = subprocess.run([*_ruff(), "check", "--no-cache", "--output-format", "concise", ROOT], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
