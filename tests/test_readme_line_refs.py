"""Each ``file.py:Lx-Ly`` range a recipe README names lies in that file, starts and ends on a line of code, and holds
a name its README line gives: a range that moved with an edit above it fails one of the two."""

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


def test_every_line_range_holds_a_name_its_readme_line_gives():
    """A range whose bullet names code (backticked, 4+ letters, between the neighbouring ranges) holds one of those
    names: a range left behind by an edit usually still starts on code, but not on the code it describes."""
    bad, checked = [], 0
    for readme in sorted(ROOT.glob("recipes/*/README.md")):
        text = readme.read_text()
        refs = list(REF.finditer(text))
        for i, m in enumerate(refs):
            start = max(
                refs[i - 1].end() if i else 0, text.rfind("\n- ", 0, m.start()), text.rfind("\n\n", 0, m.start())
            )
            ends = [refs[i + 1].start()] if i + 1 < len(refs) else []
            ends += [e for e in (text.find("\n- ", m.end()), text.find("\n\n", m.end())) if e >= 0]
            words = " ".join(
                re.findall(r"`([^`]+)`", text[start : m.start()] + text[m.end() : min(ends, default=None)])
            )
            names = {w for w in re.findall(r"[A-Za-z_]\w{3,}", words)}
            if not names:
                continue
            checked += 1
            lines = (readme.parent / m.group(1)).read_text().splitlines()
            body = "\n".join(lines[int(m.group(2)) - 1 : int(m.group(3) or m.group(2))])
            if not any(name in body for name in names):
                bad.append(f"{readme.relative_to(ROOT)}: {m.group(0)} holds none of {sorted(names)}")
    assert checked >= 25 and bad == []
