"""The README's sentence on the test suite's time is the committed record's (scripts/record_test_run.sh)."""

import importlib.util
import json

from conftest import RECORD, ROOT


def test_the_readme_states_the_recorded_fresh_clone_run():
    spec = importlib.util.spec_from_file_location("suite_record", ROOT / "scripts" / "suite_record.py")
    suite_record = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(suite_record)
    record = json.loads(RECORD.read_text())
    assert " passed" in record["summary"]
    assert {"date", "commit", "host", "command", "pytest_s", "wall_s", "module_seconds"} <= set(record)
    readme = (ROOT / "README.md").read_text()
    assert suite_record.readme_with(readme, record) == readme, "run: python3 scripts/suite_record.py --readme README.md"
    assert record["command"] in readme  # the README's test command is the one recorded
