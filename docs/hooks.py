"""mkdocs hook: the committed results (REPORT.md, README.md, every summary.md and plot) become pages of
the site, exactly as the report command wrote them, under results/."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

RESULTS = Path(__file__).resolve().parents[1] / "results"


def on_files(files, config):
    for path in sorted(RESULTS.rglob("*")):
        if path.suffix in (".md", ".png") and "runs" not in path.parts:
            rel = path.relative_to(RESULTS.parent).as_posix()
            files.append(File(rel, str(RESULTS.parent), config["site_dir"], config["use_directory_urls"]))
    return files
