"""The README's code and commands are what users copy: keep them working."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, re.S)


def test_usage_example_runs():
    blocks = _python_blocks()
    assert blocks, "README has no python example"
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)  # noqa: S102 - our own README
    assert float(namespace["isometry_error"](namespace["attn"].w_q)) < 1e-5


def test_transformers_example_runs():
    pytest.importorskip("transformers")
    from stiefel_attention import frames, isometry_error

    (block,) = [b for b in _python_blocks() if "stiefelize(" in b]
    namespace: dict = {}
    exec(compile(block, "README.md", "exec"), namespace)  # noqa: S102 - our own README
    model = namespace["model"]
    assert len(frames(model)) == 4 and all(float(isometry_error(p)) < 1e-5 for _, p in frames(model))
    assert namespace["opt"].state  # it stepped


def test_ci_runs_the_readme_test_command():
    ci = (Path(__file__).resolve().parents[1] / ".ci" / "run").read_text()
    assert "<!-- test-command -->" in README and "test-command" in ci
    command = README.split("<!-- test-command -->", 1)[1].split("```bash\n", 1)[1].split("\n", 1)[0]
    assert "pytest" in command and "torch==" in command
