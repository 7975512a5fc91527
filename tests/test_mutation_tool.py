"""tools/mutate.py, the mutation check, without a full run: the registry applies to the current code; a mutant
that no longer matches is stale; in a small project of its own, a mutant is killed in a scratch copy whose package
is the one its tests import (not the installed one), the working tree stays as it was, and tests that fail
unmutated give an error; and the verdict's arithmetic."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MANIFOLD = "src/stiefel_attention/manifold.py"


@pytest.fixture(scope="module")
def tool():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import mutate
    finally:
        sys.path.remove(str(ROOT / "tools"))
    return mutate


def _mutant(tool, old: str, new: str, **kw):
    fields = dict(id="T1", file=MANIFOLD, edits=((old, new),), description="test", tests=("tests/test_manifold.py",))
    return tool.Mutant(**{**fields, **kw})


def test_every_registered_mutant_is_well_formed_and_applies_to_the_current_code(tool):
    """A mutant whose text the code no longer holds checks nothing: update tools/mutants.py with the code."""
    ids = [m.id for m in tool.MUTANTS]
    assert len(ids) == len(set(ids)) and len(ids) >= 31 + 20
    for m in tool.MUTANTS:
        assert m.edits and all(old != new for old, new in m.edits), m.id
        assert m.tests and all(t.startswith("tests/test_") for t in m.tests), m.id
        assert not m.equivalent or m.reason, f"{m.id}: an equivalent mutant says why"
        assert tool.stale_reason(ROOT, m) == "", f"{m.id}: {tool.stale_reason(ROOT, m)}"


FAKE = {  # a project of its own whose package has the library's name: importing the installed one would fail
    "src/stiefel_attention/__init__.py": "",
    "src/stiefel_attention/manifold.py": "def sym(a, b):\n    return 0.5 * (a + b)\n",
    "tests/test_manifold.py": (
        "from pathlib import Path\n\nimport stiefel_attention\nfrom stiefel_attention.manifold import sym\n\n\n"
        "def test_sym():\n"
        "    assert Path(stiefel_attention.__file__).parents[2] == Path(__file__).parents[1]  # this copy's package\n"
        "    assert sym(1.0, 3.0) == 2.0\n"
    ),
    "tests/test_broken.py": "def test_broken():\n    assert False\n",
}


@pytest.fixture
def fake_root(tmp_path):
    root = tmp_path / "repo"
    for name, text in FAKE.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_a_mutant_whose_old_string_does_not_occur_exactly_once_is_stale_and_runs_nothing(tool, fake_root):
    runner = tool.Runner(fake_root, files=sorted(FAKE))
    absent = runner.run(_mutant(tool, "return 0.5 * (a + b)  # gone", "x"))
    twice = runner.run(_mutant(tool, "(a", "(b"))
    assert (absent.status, absent.detail) == ("stale", f"its old string occurs 0 times in {MANIFOLD}, not once")
    assert (twice.status, twice.detail) == ("stale", f"its old string occurs 2 times in {MANIFOLD}, not once")
    assert runner.baselines == {}  # nothing ran
    results = [absent, tool.Result(_mutant(tool, "a", "b"), "killed")]
    assert tool.problems(results) == ["stale: T1"]


def test_a_cheap_mutant_is_killed_in_a_scratch_copy_and_the_working_tree_is_untouched(
    tool, fake_root, tmp_path, monkeypatch
):
    root, scratch = fake_root, tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where the scratch copies go, to see them removed
    runner = tool.Runner(root, files=sorted(FAKE), timeout_s=120)
    edit = dict(file=MANIFOLD, edits=(("return 0.5 * (a + b)", "return a + b"),))
    killed, error = runner.run_all(
        [
            tool.Mutant("K", description="sym without 1/2", tests=("tests/test_manifold.py",), **edit),
            tool.Mutant("E", description="", tests=("tests/test_broken.py",), **edit),
        ]
    )
    assert (killed.status, killed.detail) == ("killed", "tests/test_manifold.py::test_sym"), killed
    assert "1 failed" in killed.pytest_line
    # the unmutated test passed first, importing the scratch copy's package (its first assertion)
    assert runner.baselines[(("tests/test_manifold.py",), None)].pytest_line.startswith("1 passed")
    assert (error.status, error.detail) == ("error", "unmutated tests fail: tests/test_broken.py::test_broken")
    assert {name: (root / name).read_text() for name in FAKE} == FAKE  # the working tree as it was
    assert list(scratch.iterdir()) == []  # the snapshot and every scratch copy removed


def test_the_kill_rate_leaves_out_equivalent_survivors_and_a_survivor_needs_a_reason(tool):
    def results(n_killed: int, survivors: list) -> list:
        killed = [tool.Result(_mutant(tool, "a", "b", id=f"K{i}"), "killed") for i in range(n_killed)]
        return killed + [tool.Result(m, "survived") for m in survivors]

    equivalent = _mutant(tool, "a", "b", id="E1", reason="the same arithmetic", equivalent=True)
    missing = _mutant(tool, "a", "b", id="S1", reason="no test runs it on a 2-D mesh")
    silent = _mutant(tool, "a", "b", id="S2")
    assert tool.kill_rate(results(19, [equivalent])) == 1.0
    assert tool.kill_rate(results(19, [missing])) == 0.95 and tool.problems(results(19, [missing])) == []
    assert tool.problems(results(18, [missing, equivalent])) == ["kill rate 94.7% < 95%"]
    assert tool.problems(results(40, [silent])) == ["survived with no reason in tools/mutants.py: S2"]
    text = tool.report(results(19, [missing]), "abc1234")
    assert "**20 mutants: 19 killed, 1 survived (0 equivalent), 0 stale, 0 error; kill rate 95.0%" in text
    assert "- S1 (not equivalent): test. no test runs it on a 2-D mesh" in text
