"""MkDocs hook: build the site from the repository as it is laid out, so that one relative link works on GitHub and
in the site. The pages are README.md, docs/*.md, benchmarks/*.md and recipes/*/README.md at their repository paths;
every other file git knows (tracked, or new and not ignored) is copied as it is, so a link to a missing file or
heading fails ``mkdocs build --strict``."""

from __future__ import annotations

import subprocess
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]


def repo_files() -> list[str]:
    """Paths, relative to the repository root, of the files git tracks plus the new ones it does not ignore."""
    out = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return sorted({p for p in out.splitlines() if (ROOT / p).is_file()})


def on_files(files: Files, config) -> Files:
    """Replace the docs_dir's files by the repository's (the theme's assets are kept)."""
    site = Files([f for f in files if not f.abs_src_path or not Path(f.abs_src_path).is_relative_to(ROOT)])
    for path in repo_files():
        if path.startswith("site/") or path == "mkdocs.yml":
            continue
        site.append(File(path, str(ROOT), config["site_dir"], config["use_directory_urls"]))
    return site
