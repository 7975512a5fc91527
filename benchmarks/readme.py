"""Write a benchmark's measured table into a markdown page (docs/performance.md), between a pair of markers,
so the page shows exactly what the last committed run printed."""

from __future__ import annotations


def replace_block(
    path: str, text: str, start: str = "<!-- benchmark:start -->", end: str = "<!-- benchmark:end -->"
) -> None:
    with open(path) as f:
        content = f.read()
    if start not in content or end not in content:
        raise SystemExit(f"{path} has no {start} ... {end} block")
    head, rest = content.split(start, 1)
    _, tail = rest.split(end, 1)
    with open(path, "w") as f:
        f.write(f"{head}{start}\n{text}\n{end}{tail}")
