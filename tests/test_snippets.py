"""Every Python snippet of README.md and docs/ runs as written: each in a fresh namespace, the one that starts a
process group under torchrun's environment in a process of its own. A snippet added to the docs is run here
with no change to this file."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def snippets() -> list[tuple[str, str]]:
    """(page:line, code) of every ```python block of the README and the docs."""
    out = []
    for page in PAGES:
        text = page.read_text()
        for match in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
            line = text[: match.start()].count("\n") + 1
            out.append((f"{page.relative_to(ROOT).as_posix()}:{line}", match.group(1)))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_docs_have_snippets_to_run():
    names = [name for name, _ in snippets()]
    assert len(names) >= 6 and any(n.startswith("README.md") for n in names), names


@pytest.mark.parametrize(("where", "code"), snippets(), ids=[name for name, _ in snippets()])
def test_the_snippet_runs_as_written(where, code):
    if "transformers" in code:
        pytest.importorskip("transformers")
    if "init_process_group" in code:  # as torchrun would start it: one process, its own port, a deadline
        env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
        env["MASTER_PORT"] = str(_free_port())
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=240, cwd=ROOT
        )
        assert done.returncode == 0, f"{where}:\n{done.stderr[-3000:]}"
        return
    exec(compile(code, where, "exec"), {"__name__": "__snippet__"})  # noqa: S102 - our own docs
