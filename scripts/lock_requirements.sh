#!/usr/bin/env bash
# Rewrite requirements/constraints.txt from a fresh install of requirements/test.txt and requirements/docs.txt (CPU,
# Python 3.11).
# Usage: bash scripts/lock_requirements.sh   (takes a few minutes; review the diff before committing it)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(mktemp -d)/venv
python3 -m venv "$venv"
"$venv/bin/pip" install -q -r requirements/test.txt -r requirements/docs.txt -e shared
"$venv/bin/pip" install -q --no-deps "$(grep -i "^torchrec==" requirements/constraints.txt)"
{ sed -n '1,/^# Regenerate/p' requirements/constraints.txt
  "$venv/bin/pip" freeze --exclude-editable | grep -v -i -E "^(torch|cookbook)==" | sort -f
  grep -i "^torchvision==" requirements/constraints.txt; } > requirements/constraints.txt.new
mv requirements/constraints.txt.new requirements/constraints.txt
rm -rf "$(dirname "$venv")"
git --no-pager diff --stat requirements/constraints.txt
