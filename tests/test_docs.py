"""The documentation site builds with --strict (broken links, bad docstrings and missing pages fail)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_docs_build_strictly(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    build = subprocess.run(
        # not -q: quiet mode hides the warnings strict mode counts (a broken link passed with it)
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    assert "WARNING" not in build.stdout + build.stderr, build.stdout + build.stderr
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "StiefelAdam" in api and "stiefelize" in api and "param_groups" in api
    assert (tmp_path / "site" / "results" / "REPORT" / "index.html").exists()
