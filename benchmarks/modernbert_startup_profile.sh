#!/usr/bin/env bash
# Where modernbert-ddp's start-up goes (issue 37 item 1), one GPU, one call: benchmarks/modernbert_vs_hf_trainer.sh
# (the HF Trainer, then the recipe compiled and eager, each with empty compile caches), then, with the page cache
# warm, python -X importtime of what the launcher imports and of train.py's module imports (what the check process
# imports; each worker adds transformers' modeling code in main), and the check process alone, timed (reading,
# tokenizing and caching the rows).
#   DATA=.data/ag_news TOKENIZER_DIR=.data/modernbert OUT=$OUT bash benchmarks/modernbert_startup_profile.sh
# Writes to OUT what modernbert_vs_hf_trainer.sh writes (6 files) and startup-profile.txt: the check's wall time,
# the 15 top-level imports with the most cumulative time of each importtime tree, then both trees (entries of 5 ms
# or more) and the check's output. 7 files: the device tool brings 8 back.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export WORK=${WORK:-/tmp/mb-vs-hf}
VARIANTS=${VARIANTS:-"recipe: eager-longest:model.compile=false,data.padding=longest"} bash benchmarks/modernbert_vs_hf_trainer.sh
python3 -X importtime -c "import cookbook.launch, torch; torch.cuda.device_count()" 2> "$WORK/importtime-launch.txt"
python3 -X importtime recipes/modernbert-ddp/train.py --help > /dev/null 2> "$WORK/importtime-train.txt"
t0=$(date +%s.%N)
COOKBOOK_WORLD_SIZE=1 python3 recipes/modernbert-ddp/train.py --check --config recipes/modernbert-ddp/config.yaml \
  output_dir=/tmp/mb-check mlflow=false model.name_or_path="$WORK/model" model.pretrained=false \
  "data.train_files=[$WORK/train.csv]" "data.eval_files=[$WORK/heldout.csv]" train.micro_batch_size=64 train.epochs=3 \
  checkpoint.every_steps=-1 checkpoint.export_hf=false > "$WORK/check.log" 2>&1
t1=$(date +%s.%N)
python3 - "$WORK" "$t0" "$t1" > "$OUT/startup-profile.txt" <<'PY'
import sys
from pathlib import Path
out, t0, t1 = Path(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
print(f"check process alone (train.py --check, empty tokenized cache): {t1 - t0:.1f} s wall")
for name in ("launch", "train"):
    top, total = [], 0
    for line in (out / f"importtime-{name}.txt").read_text().splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        _, cum, mod = line.split(":", 1)[1].split("|")
        if mod.startswith("  "):  # nested: a top-level module has one space after the bar
            continue
        top.append((int(cum) / 1e6, mod.strip()))
        total += int(cum) / 1e6
    print(f"\nimporttime-{name}.txt: top-level imports {total:.2f} s")
    for s, m in sorted(top, reverse=True)[:15]:
        print(f"  {s:6.2f} s  {m}")
PY
cat "$OUT/startup-profile.txt"
for n in launch train; do
  echo "--- python -X importtime, $n, entries of 5 ms or more: self [us] | cumulative [us] | package"
  awk -F'|' '/^import time:/ && $2+0>=5000' "$WORK/importtime-$n.txt"
done >> "$OUT/startup-profile.txt"
{ echo "--- train.py --check"; cat "$WORK/check.log"; } >> "$OUT/startup-profile.txt"
