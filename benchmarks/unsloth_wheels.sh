#!/usr/bin/env bash
# Fill ./.whl-ft (repository root, git-ignored) with Unsloth for benchmarks/unsloth_axolotl_vs_trl.sh's unsloth path:
# unsloth 2026.10.9 without studio/ (its web UI and installers: 28.6 -> ~3 MB), unsloth_zoo, cut_cross_entropy.
# The script installs them on top of .whl (trl, datasets, omegaconf: the TRL path's environment) with
# .whl-axo's bitsandbytes and xxhash, all with --no-deps.
#   bash benchmarks/unsloth_wheels.sh          # from the repository root; ~10 s
set -euo pipefail
dest=${1:-.whl-ft}
mkdir -p "$dest"
exclude="$(git rev-parse --git-common-dir)/info/exclude"
grep -qx '/.whl-ft/' "$exclude" 2>/dev/null || echo '/.whl-ft/' >> "$exclude"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation py --platform any \
  -d "$tmp" unsloth==2026.10.9 unsloth_zoo==2026.10.9 cut_cross_entropy==25.1.1
cp "$tmp"/unsloth_zoo-*.whl "$tmp"/cut_cross_entropy-*.whl "$dest"/
python3 "$(dirname "$0")/strip_wheel.py" "$dest" "$tmp"/unsloth-2026.10.9-*.whl '^studio/'
