#!/usr/bin/env bash
# Run the README's test command (.ci/run) on a fresh clone of HEAD and write tests/suite_record.json: host, date,
# commit, pytest's summary line and seconds, and the seconds of each test module (conftest.py hands the longest
# groups out first), and rewrite README.md's sentence on the suite's time from it.
# Run it on an idle machine and commit both.   Usage: bash scripts/record_test_run.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
commit=$(git -C "$root" rev-parse HEAD)  # the commit cloned: HEAD may move while the suite runs
git clone -q "$root" "$work/clone" && git -C "$work/clone" checkout -q "$commit"
start=$(date +%s)
(cd "$work/clone" && CI=true PYTEST_ADDOPTS="--junitxml=$work/junit.xml" bash .ci/run) 2>&1 | tee "$work/out.log"
python3 "$root/scripts/suite_record.py" --log "$work/out.log" --junit "$work/junit.xml" \
  --commit "$commit" --wall-s $(( $(date +%s) - start )) > "$root/tests/suite_record.json"
rm -rf "$work"
python3 "$root/scripts/suite_record.py" --readme "$root/README.md"
echo "wrote tests/suite_record.json and README.md's sentence on it"
