"""mkdocs hook: the committed results of both profiles (REPORT.md, README.md, every summary.md and plot) become
pages of the site, exactly as the report command wrote them, under results/ and results-paper/ (each REPORT links
the other's rows)."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("results", "results-paper")


def on_files(files, config):
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in (".md", ".png") and "runs" not in path.parts:
                rel = path.relative_to(ROOT).as_posix()
                files.append(File(rel, str(ROOT), config["site_dir"], config["use_directory_urls"]))
    return files
