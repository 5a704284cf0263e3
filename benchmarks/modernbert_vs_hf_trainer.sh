#!/usr/bin/env bash
# Issue 37, item 1: the whole modernbert-ddp job beside the Hugging Face Trainer, one GPU, one call, compile caches
# empty. ModernBERT-base architecture (random init), the ModernBERT tokenizer, AG News rows of ../shared/data:
# hf_subset_train_5000.csv to train on (EPOCHS epochs, micro-batch 64, max_length 256), and the rows of train.csv
# whose text is not among them (about 1,900) held out for the evaluation at the end. The reference runs first
# (benchmarks/modernbert_hf_trainer.py, attention HF_ATTN: default the recipe's sdpa_padsafe; plain sdpa gives NaN
# gradients on padded batches and chance accuracy), then recipes/modernbert-ddp/launch.sh (NGPU=1) for each VARIANTS entry
# (name:override,override...), each with inductor's and Triton's caches in an empty folder of its own. The Python
# imports are warmed once before all runs (page cache), so no run pays the cold disk alone.
#   bash benchmarks/modernbert_vs_hf_trainer.sh       # device; DATA (ag_news) and TOKENIZER_DIR (modernbert) folders
#   DATA=.data/ag_news TOKENIZER_DIR=.data/modernbert OUT=$OUT bash benchmarks/modernbert_vs_hf_trainer.sh
# Writes $OUT/results.jsonl: per run launch-to-exit wall_s, startup_s (launch to the end of step 1), its phases,
# steady samples/s, held-out accuracy and macro-F1; $OUT/<run>.log (last lines), $OUT/<run>-metrics.jsonl.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT=${OUT:-outputs/bench-modernbert-vs-hf}
mkdir -p "$OUT"; OUT="$(cd "$OUT" && pwd)"
WORK=${WORK:-/tmp/mb-vs-hf}
DATA=${DATA:-$ROOT/.data/ag_news}
TOKENIZER_DIR=${TOKENIZER_DIR:-$ROOT/.data/modernbert}
EPOCHS=${EPOCHS:-3}
VARIANTS=${VARIANTS:-"recipe:"}
EXTRA=${EXTRA:-}                     # e.g. TINY runs: model.compile=false (CPU)
HF=${HF:-1}
RESULTS="$OUT/results.jsonl"
: > "$RESULTS"
rm -rf "$WORK"; mkdir -p "$WORK"
say() { echo "$(date -u +%H:%M:%S) $*"; }
now() { date +%s.%N; }
python3 - "$DATA" "$TOKENIZER_DIR" "$WORK" "${TINY:-0}" <<'PY' || exit 1
import csv, sys
from pathlib import Path
from transformers import AutoTokenizer, ModernBertConfig
data, tok, work, tiny = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), sys.argv[4] == "1"
cfg = ModernBertConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4) if tiny \
    else ModernBertConfig()  # ModernBERT-base: ModernBertConfig's defaults (768 hidden, 22 layers)
cfg.save_pretrained(work / "model")
AutoTokenizer.from_pretrained(tok).save_pretrained(work / "model")
train = [(r[0], int(r[1])) for r in csv.reader(open(data / "hf_subset_train_5000.csv", newline=""))]
seen = {t for t, _ in train}
held = [(f"{r[1]} {r[2]}".replace("\\n", " ").strip(), int(r[0]) - 1) for r in csv.reader(open(data / "train.csv", newline=""))]
held = [(t, l) for t, l in held if t not in seen]
for name, rows in (("train", train), ("heldout", held)):
    with open(work / f"{name}.csv", "w", newline="") as f:
        w = csv.writer(f); w.writerow(["text", "label"]); w.writerows(rows)
print(f"{len(train)} train rows, {len(held)} held-out rows (train.csv less {2000 - len(held)} texts also in the train rows)")
PY
# The bytecode of the carried wheels (PYTHONPATH; installed with --no-compile), as pip install writes it by default:
# without it, the first run to import a module compiles it from source.
for d in ${PYTHONPATH:+${PYTHONPATH//:/ }}; do [[ -d $d ]] && { t=$(now); python3 -m compileall -q -j 0 "$d" >/dev/null; say "bytecode of $d: $(python3 -c "import time; print(round(time.time() - $t, 1))") s"; }; done
python3 -c "import torch, transformers, datasets, torchdata, accelerate; torch.cuda.is_available()" 2>/dev/null  # warm the page cache

if [[ "$HF" == 1 ]]; then
  say "[hf_trainer] Trainer, $EPOCHS epochs"
  t0=$(now)
  BENCH_T0=$t0 python3 benchmarks/modernbert_hf_trainer.py --model "$WORK/model" --train "$WORK/train.csv" --eval "$WORK/heldout.csv" \
    --out "$WORK/hf_trainer" --epochs "$EPOCHS" --attn "${HF_ATTN:-sdpa_padsafe}" > "$WORK/hf_trainer.log" 2>&1
  rc=$?; t1=$(now)
  tail -n 40 "$WORK/hf_trainer.log" > "$OUT/hf_trainer.log"
  python3 - "$WORK/hf_trainer/result.json" "$t0" "$t1" "$rc" >> "$RESULTS" <<'PY'
import json, sys
from pathlib import Path
p, t0, t1, rc = Path(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
r = json.loads(p.read_text()) if p.is_file() else {"path": "hf_trainer", "error": f"exit status {rc}"}
r["launch_to_exit_s"] = t1 - t0
print(json.dumps(r))
PY
  say "[hf_trainer] exit status $rc"
fi
for variant in $VARIANTS; do
  name=${variant%%:*} overrides=()
  [[ $variant == *:?* ]] && IFS=, read -r -a overrides <<< "${variant#*:}"
  run="$WORK/$name"
  say "[$name] recipes/modernbert-ddp/launch.sh ${overrides[*]} $EXTRA"
  t0=$(now)
  COOKBOOK_LAUNCH_TIME=$t0 NGPU=${NGPU:-1} MAX_RESTARTS=0 TORCHINDUCTOR_CACHE_DIR="$WORK/$name-inductor" TRITON_CACHE_DIR="$WORK/$name-triton" \
    bash recipes/modernbert-ddp/launch.sh output_dir="$run" run_name="$name" mlflow=false \
    model.name_or_path="$WORK/model" model.pretrained=false "data.train_files=[$WORK/train.csv]" \
    "data.eval_files=[$WORK/heldout.csv]" train.micro_batch_size=64 "train.epochs=$EPOCHS" train.eval_every=0 \
    train.log_every=10 checkpoint.every_steps=-1 checkpoint.export_hf=false ${overrides[@]+"${overrides[@]}"} $EXTRA \
    > "$WORK/$name.log" 2>&1
  rc=$?; t1=$(now)
  tail -n 40 "$WORK/$name.log" > "$OUT/$name.log"
  cp "$run/metrics.jsonl" "$OUT/$name-metrics.jsonl" 2>/dev/null
  python3 - "$run/metrics.jsonl" "$t0" "$t1" "$rc" "$name" "$variant" >> "$RESULTS" <<'PY'
import json, statistics, sys
from pathlib import Path
p, t0, t1, rc, name, variant = Path(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), *sys.argv[5:]
recs = [json.loads(l) for l in p.read_text().splitlines()] if p.is_file() else []
summ = [r for r in recs if r.get("event") == "summary"]
train = [r for r in recs if r.get("event") == "train" and r["step"] > 10]
r = {"path": name, "variant": variant, "launch_to_exit_s": t1 - t0, "exit_status": rc}
if summ:
    s = summ[-1]
    r.update({k: s.get(k) for k in ("startup_s", "first_step_s", "final_eval_s", "startup_phases", "tokenized_cache")})
    r.update(accuracy=s.get("eval/accuracy"), macro_f1=s.get("eval/macro_f1"), eval_rows=s.get("eval/samples"))
if train:
    r["steady_samples_per_s"] = statistics.median(x["samples_per_s"] for x in train)
    r["peak_alloc_gib"] = max(x.get("peak_alloc_gib") or 0 for x in train)
print(json.dumps(r))
PY
  say "[$name] exit status $rc"
done
python3 - "$RESULTS" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("| run | launch to exit s | launch to end of step 1 s | steady samples/s | held-out accuracy | macro-F1 |")
print("|---|---|---|---|---|---|")
f = lambda v, d=1: "" if v is None else f"{v:.{d}f}"
for r in rows:
    print(f"| {r['path']} | {f(r.get('launch_to_exit_s'))} | {f(r.get('startup_s', r.get('first_step_s')))} | "
          f"{f(r.get('steady_samples_per_s'), 0)} | {f(r.get('accuracy'), 4)} | {f(r.get('macro_f1'), 4)} |")
PY
