"""Each ``file.py:Lx-Ly`` range a recipe README names lies in that file and starts and ends on a line of code: a
range that moved with an edit above it mostly starts or ends on a blank line or outside the file."""

from __future__ import annotations

import re

from conftest import ROOT

REF = re.compile(r"`([\w./-]+\.py):L(\d+)(?:-L(\d+))?`")


def test_every_line_range_in_a_recipe_readme_starts_and_ends_on_code():
    bad, seen = [], 0
    for readme in sorted(ROOT.glob("recipes/*/README.md")):
        for m in REF.finditer(readme.read_text()):
            seen += 1
            lines = (readme.parent / m.group(1)).read_text().splitlines()
            first, last = int(m.group(2)), int(m.group(3) or m.group(2))
            if not (1 <= first <= last <= len(lines)) or not lines[first - 1].strip() or not lines[last - 1].strip():
                bad.append(f"{readme.relative_to(ROOT)}: {m.group(0)}")
    assert seen >= 40 and bad == []
