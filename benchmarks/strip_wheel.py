"""Copy a wheel into a folder without the files whose names match a pattern (its RECORD rewritten to match), to
bring a large wheel under the device call's size limit.

    python benchmarks/strip_wheel.py DEST_DIR WHEEL REGEX     # re.search on each archive name; prints the sizes
"""

from __future__ import annotations

import re
import sys
import zipfile
from pathlib import Path


def strip(wheel: Path, dest: Path, pattern: str) -> Path:
    """Write ``dest/<wheel's name>`` without the entries matching `pattern`; returns its path."""
    drop = re.compile(pattern).search
    out = dest / wheel.name
    with zipfile.ZipFile(wheel) as zin, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zout:
        for item in zin.infolist():
            if drop(item.filename):
                continue
            data = zin.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                data = "".join(l for l in data.decode().splitlines(True) if not drop(l.split(",")[0])).encode()
            zout.writestr(item, data)
    return out


if __name__ == "__main__":
    dest, wheel, pattern = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    out = strip(wheel, dest, pattern)
    print(f"{out}: {wheel.stat().st_size / 2**20:.1f} -> {out.stat().st_size / 2**20:.1f} MiB")
