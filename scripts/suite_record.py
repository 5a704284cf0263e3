"""Print the JSON record of a test run (see scripts/record_test_run.sh): host, date, commit, pytest's summary line
and seconds, the seconds of each test module (setup + call + teardown, from pytest's JUnit XML); `--readme`
rewrites the README's sentence on the suite's time from the record (``<!-- suite-time -->``)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


MARKS = ("<!-- suite-time -->", "<!-- /suite-time -->")


def sentence(record: dict) -> str:
    """The README's sentence on the test command's time, from a record."""
    return (
        f"On {record['date']}, `CI=true bash .ci/run` on a fresh clone (commit {record['commit'][:7]}, "
        f"{record['host']}) took {record['wall_s'] / 60:.1f} minutes, {record['pytest_s'] / 60:.1f} of them in "
        f"pytest: `{record['summary']}` (`tests/suite_record.json`)."
    )


def readme_with(text: str, record: dict) -> str:
    """`text` (README.md) with the sentence between `MARKS` replaced by `sentence(record)`."""
    head, rest = text.split(MARKS[0], 1)
    return head + MARKS[0] + sentence(record) + MARKS[1] + rest.split(MARKS[1], 1)[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--readme", help="rewrite this README.md from the record in tests/suite_record.json and exit")
    p.add_argument("--log", required=True, help="the run's output")
    p.add_argument("--junit", required=True)
    p.add_argument("--commit", required=True)
    p.add_argument("--wall-s", type=int, required=True, help="seconds of the whole command, install included")
    if "--readme" in sys.argv:
        readme = Path(sys.argv[sys.argv.index("--readme") + 1])
        record = json.loads((Path(__file__).resolve().parents[1] / "tests" / "suite_record.json").read_text())
        readme.write_text(readme_with(readme.read_text(), record))
        return
    a = p.parse_args()
    lines = open(a.log, encoding="utf-8", errors="replace").read().splitlines()
    summary = next(
        ln.strip("= ") for ln in lines if re.search(r"\d+ (passed|failed).* in [\d.]+s", ln)
    )  # the README command's
    command = next(ln[2:] for ln in lines if ln.startswith("+ python3 -m venv"))
    modules: dict[str, float] = defaultdict(float)
    for case in ET.parse(a.junit).getroot().iter("testcase"):
        modules[case.get("classname").split(".")[0] + "/" + case.get("classname").split(".")[1] + ".py"] += float(
            case.get("time")
        )
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "")
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": a.commit,
        "host": f"{platform.node()}: {os.cpu_count()} cores ({cpu}), Python {platform.python_version()}",
        "command": command,
        "summary": summary,
        "pytest_s": float(re.search(r" in ([\d.]+)s", summary).group(1)),
        "wall_s": a.wall_s,
        "module_seconds": {m: round(s, 1) for m, s in sorted(modules.items(), key=lambda kv: -kv[1])},
    }
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
