"""The two layers: a torch-only library and a benchmark suite on top of it, with no import cycle."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "stiefel_attention"
CORE = ("manifold", "optim", "nn", "metrics", "certify", "convert")
BENCH_ONLY = ("numpy", "scipy", "matplotlib", "PIL", "tqdm", "transformers", "stiefel_attention.bench")


sys.path.insert(0, str(ROOT / "tools"))
import import_graph  # noqa: E402

sys.path.remove(str(ROOT / "tools"))
GRAPH = import_graph.graph()  # {module: the package's modules it imports}


def test_no_core_module_imports_the_benchmark_layer():
    for name, deps in GRAPH.items():
        if not name.startswith("stiefel_attention.bench"):
            assert not {d for d in deps if d.startswith("stiefel_attention.bench")}, name


def test_no_import_cycle():
    done: set[str] = set()

    def visit(node: str, stack: list[str]) -> None:
        if node in stack:
            pytest.fail("import cycle: " + " -> ".join(stack[stack.index(node) :] + [node]))
        if node in done:
            return
        for dep in sorted(GRAPH.get(node, ())):
            if dep != "stiefel_attention" or node.startswith("stiefel_attention.bench"):
                visit(dep, stack + [node])
        done.add(node)

    for name in sorted(GRAPH):
        visit(name, [])


def test_importing_the_library_loads_no_benchmark_dependency():
    """Beyond what `import torch` loads by itself (numpy and tqdm where they are installed)."""
    code = (
        "import sys, torch; before = set(sys.modules); import stiefel_attention, "
        + ", ".join(f"stiefel_attention.{m}" for m in CORE)
        + f"; print(sorted(m for m in {BENCH_ONLY!r} if m in set(sys.modules) - before))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]", out


def test_the_library_requires_torch_alone():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert [d.split(">")[0].split("=")[0] for d in project["dependencies"]] == ["torch"]
    assert {"numpy", "scipy", "matplotlib", "pillow", "tqdm"} <= {
        d.split(">")[0].split("=")[0] for d in project["optional-dependencies"]["bench"]
    }


def test_ruff_lint_and_format_are_clean():
    """Lines of at most 120 characters, sorted imports, no unused names, one formatting style."""
    ruff = [sys.executable, "-m", "ruff"]
    if subprocess.run([*ruff, "--version"], capture_output=True).returncode != 0:
        pytest.skip("ruff is not installed (it is in the test extra)")
    paths = [str(ROOT / p) for p in ("src", "tests", "benchmarks", "examples", "tools")]
    lint = subprocess.run([*ruff, "check", "--no-cache", *paths], capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    fmt = subprocess.run([*ruff, "format", "--check", "--no-cache", *paths], capture_output=True, text=True)
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def test_no_benchmark_module_imports_a_higher_layer_or_another_family():
    """tools/import_graph.py's layers: base < report < sequence < families < cli, and no family imports another."""
    assert import_graph.climbs(GRAPH) == []
    planted = {
        "stiefel_attention.bench.report.geometry": {"stiefel_attention.bench.lm.report"},
        "stiefel_attention.bench.mqar.run": {"stiefel_attention.bench.lm.run"},
        "stiefel_attention.bench.records": {"stiefel_attention.bench.cli"},
    }
    assert len(import_graph.climbs(planted)) == 3  # the check sees each kind of climb
