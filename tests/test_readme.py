"""The README's code and commands are what users copy: keep them working."""

from __future__ import annotations

import re
from pathlib import Path

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_usage_example_runs():
    block = re.search(r"```python\n(.*?)```", README, re.S)
    assert block, "README has no python example"
    namespace: dict = {}
    exec(compile(block.group(1), "README.md", "exec"), namespace)  # noqa: S102 - our own README
    assert float(namespace["isometry_error"](namespace["attn"].w_q)) < 1e-5


def test_ci_runs_the_readme_test_command():
    ci = (Path(__file__).resolve().parents[1] / ".ci" / "run").read_text()
    assert "<!-- test-command -->" in README and "test-command" in ci
    command = README.split("<!-- test-command -->", 1)[1].split("```bash\n", 1)[1].split("\n", 1)[0]
    assert "pytest" in command and "torch==" in command
