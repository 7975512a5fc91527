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


def test_the_findings_block_is_what_the_committed_summaries_say():
    """README's "What we found" is computed from results/ (report --readme), so it cannot drift from them."""
    from stiefel_attention.bench.report import FINDINGS_END, FINDINGS_START, findings_lines

    root = Path(__file__).resolve().parents[1]
    block = README.split(FINDINGS_START + "\n", 1)[1].split("\n" + FINDINGS_END, 1)[0]
    assert block.splitlines() == findings_lines(root / "results", "results"), (
        "README.md's findings are out of date: stiefel-attention report results --beside results-paper "
        "--readme README.md"
    )
    assert "[cifar/main](results/cifar/main/summary.md)" in block  # the headline claim, linked from the README
    headline = next(line for line in block.splitlines() if line.startswith("- [cifar/main]"))
    assert headline.endswith(": **does not replicate**")  # the verdict's kind; its reasons are in REPORT.md
    # where the bounded frames stand at their tuned rates, linked to REPORT's section that says so
    bounded = "- [Bounded frames](results/REPORT.md#high-learning-rates-character-level-lm-tiny-shakespeare): stiefel"
    assert bounded in block and "#### " not in block
    report = (root / "results" / "REPORT.md").read_text()
    assert "### High learning rates: character-level LM (tiny Shakespeare)" in report
    # where the frames help and cost, one line per baseline with every testbed; the longer verdicts folded
    lines = block.splitlines()
    stand = [line for line in lines if line.startswith("- [Where the frames stand](results/REPORT.md#when-does")]
    assert [line.split("): ", 1)[1].split(",", 1)[0] for line in stand] == [
        "stiefel-adam against adamw",
        "stiefel-adam against qk-norm",
        "stiefel-adam against frozen",
    ]
    for title in ("CIFAR-10 patches", "modular addition (grokking)", "character-level LM", "associative recall"):
        assert all(title in line for line in stand), title
    fold = lines.index("<details><summary>Each testbed's verdict on every arm, and the bounded frames (computed)"
                       "</summary>")  # fmt: skip
    assert lines[-1] == "</details>" and all(line.startswith("- [When does") for line in lines[fold + 2 : fold + 6])
    assert not any("When does the geometry dominate?" in line for line in lines[:fold])


@pytest.mark.parametrize(
    ("said", "kind"),
    [
        ("does not replicate: no significant difference by both tests", "not"),
        ("**does not replicate: significant effect of the opposite sign**", "not"),
        ("direction replicates, size does not: paper +1.97 pp outside the 95% CI", "direction"),
        ("replicates: no significant difference", "replicates"),
        ("ordering replicates (one seed, no test; the study is the test)", "replicates"),
        ("untestable here: neither arm reaches 95%", "other"),
        ("measured only: the paper gives no number at this n", "other"),
        ("stable grokking does not replicate, the ordering does", "other"),
    ],
)
def test_each_verdict_is_counted_as_what_it_says(said, kind):
    from stiefel_attention.bench.report import verdict_kind

    assert verdict_kind(said) == kind


def test_the_findings_go_only_between_the_markers(tmp_path):
    from stiefel_attention.bench.errors import UserError
    from stiefel_attention.bench.report import FINDINGS_END, FINDINGS_START, write_findings

    root = Path(__file__).resolve().parents[1]
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\nbefore\n{FINDINGS_START}\nold\n{FINDINGS_END}\nafter\n")
    write_findings(readme, root / "results")
    text = readme.read_text()
    assert text.startswith(f"# title\n\nbefore\n{FINDINGS_START}\nOf the paper's claims") and "\nold\n" not in text
    assert text.endswith(f"\n{FINDINGS_END}\nafter\n")
    import os

    prefix = Path(os.path.relpath(root / "results", tmp_path)).as_posix()
    assert f"[the claims table]({prefix}/REPORT.md)" in text  # links are relative to the README's folder
    readme.write_text("# no markers\n")
    with pytest.raises(UserError, match="no <!-- findings:start -->"):
        write_findings(readme, root / "results")
