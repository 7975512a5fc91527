"""The package's import graph, module by module, and the layers it must keep.

    python tools/import_graph.py            # every module of stiefel_attention.bench and what it imports
    python tools/import_graph.py --check    # exit 1 naming each import that climbs a layer

Read from the source with `ast` (nothing is imported), so it also sees imports inside functions. The layers of
the benchmark suite, lowest first; a module may import its own layer and the ones below, never one above, and a
family package never imports another family:

    base        records, errors, lock, partial, claims, family, runner, models, arms, kong, text, training
    report      bench.report.*: statistics, formatting, comparisons, summaries as typed records, REPORT.md
    sequence    bench.sequence.*: the base that lm, mqar and pretrained train and report on
    families    bench.cifar, bench.grok, bench.lm, bench.mqar, bench.pretrained (each a package)
    experiment  bench.experiment: a run request, its preflight and its run (families reached by the registry)
    cli         bench.cli: flags to requests
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "stiefel_attention"
BENCH = "stiefel_attention.bench"
FAMILIES = ("cifar", "grok", "lm", "mqar", "pretrained")
LAYERS = ("base", "report", "sequence", "families", "experiment", "cli")


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that the file imports anywhere (top level or inside functions), leaving out the
    imports under `if TYPE_CHECKING:`, which name types for annotations and never run."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
        for stmt in node.body
        for inner in ast.walk(stmt)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("stiefel_attention")}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            base = base[: len(base) - (node.level - 1)] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            if module.startswith("stiefel_attention"):
                found.add(module)
                found |= {f"{module}.{a.name}" for a in node.names}
    return {m for m in found if m in modules and m != name}


def graph() -> dict[str, set[str]]:
    """{module: the package's modules it imports}, for every module of the package."""
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports(p, modules) for p in paths}


def layer(module: str) -> str | None:
    """The benchmark layer of a module of stiefel_attention.bench (None outside it)."""
    if not module.startswith(BENCH):
        return None
    parts = module[len(BENCH) + 1 :].split(".")
    if parts[0] in ("report", "sequence", "experiment", "cli"):
        return parts[0]
    return "families" if parts[0] in FAMILIES else "base"


def family_of(module: str) -> str | None:
    parts = module[len(BENCH) + 1 :].split(".") if module.startswith(BENCH + ".") else []
    return parts[0] if parts and parts[0] in FAMILIES else None


def climbs(g: dict[str, set[str]]) -> list[str]:
    """Each import from a lower layer into a higher one, or from one family into another."""
    found = []
    for module, deps in sorted(g.items()):
        mine = layer(module)
        if mine is None:
            continue
        for dep in sorted(deps):
            theirs = layer(dep)
            if theirs is None or dep == BENCH:
                continue
            if LAYERS.index(theirs) > LAYERS.index(mine):
                found.append(f"{module} ({mine}) imports {dep} ({theirs})")
            elif theirs == "families" and family_of(dep) != family_of(module):
                found.append(f"{module} imports another family's {dep}")
    return found


def main(argv: list[str]) -> int:
    g = graph()
    if "--check" in argv:
        problems = climbs(g)
        print("\n".join(problems) or "no import climbs a layer")
        return 1 if problems else 0
    for module, deps in sorted(g.items()):
        if module.startswith(BENCH):
            short = sorted(d[len(BENCH) + 1 :] if d.startswith(BENCH + ".") else d for d in deps)
            print(f"{module[len(BENCH) + 1 :] or '(bench)'} [{layer(module)}]: {', '.join(short) or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
