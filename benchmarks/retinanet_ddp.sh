#!/usr/bin/env bash
# Throughput and a short-run mAP of recipes/retinanet-ddp on the GPU machine: RetinaNet ResNet-50-FPN v2, bf16,
# images resized by the model to 800 px short side (max 1333), micro-batch MB (default 8) per GPU.
# Data: generated here in COCO format from the recipe's 9 tiny real photos, upsampled to 1200 px wide and
# repeated (REPEAT x 9 image entries, default 64 -> 576 images; same boxes, scaled) for training; evaluation on
# the 9 upsampled images once. Weights: COCO when reachable, else (no network) random init -- the log says which.
# For each GPU count in NGPUS (default "1 2", counts above the visible GPUs are skipped): STEPS steps (default 300)
# capped at MAX_S seconds each (train.max_steps is set from a 1-GPU estimate, see below), then one evaluation.
# Results: $OUT/retinanet_ddp.jsonl (one line per run: images/s/GPU over the steps after the first 20, peak
# memory, mAP, mAP@.5), and each run's metrics.jsonl.
#   bash benchmarks/retinanet_ddp.sh [extra overrides]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT=${OUT:-outputs/bench-retinanet}
WORK=${WORK_DIR:-/tmp/bench-retinanet}
STEPS=${STEPS:-300}
MB=${MB:-8}
REPEAT=${REPEAT:-64}
mkdir -p "$OUT" "$WORK"
python3 - "$ROOT/recipes/retinanet-ddp/tiny" "$WORK/data" "$REPEAT" <<'PY'
import json, sys
from pathlib import Path
from PIL import Image
src, dst, repeat = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
(dst / "images").mkdir(parents=True, exist_ok=True)
coco = json.loads((src / "instances.json").read_text())
scale = {}
for img in coco["images"]:
    im = Image.open(src / "images" / img["file_name"]).convert("RGB")
    s = 1200 / im.size[0]
    im = im.resize((1200, round(im.size[1] * s)), Image.BICUBIC)
    im.save(dst / "images" / img["file_name"], quality=90)
    scale[img["id"]] = (s, im.size)
def scaled(rep):
    images, anns = [], []
    for r in range(rep):
        for img in coco["images"]:
            s, (w, h) = scale[img["id"]]
            iid = r * 1000 + img["id"]
            images.append({**img, "id": iid, "width": w, "height": h})
            for a in coco["annotations"]:
                if a["image_id"] == img["id"]:
                    x, y, bw, bh = a["bbox"]
                    box = [x * s, y * s, min(bw * s, w - x * s), min(bh * s, h - y * s)]
                    anns.append({**a, "id": r * 1000 + a["id"], "image_id": iid, "bbox": box, "area": box[2] * box[3]})
    return {"images": images, "annotations": anns, "categories": coco["categories"]}
(dst / "train.json").write_text(json.dumps(scaled(repeat)))
(dst / "eval.json").write_text(json.dumps(scaled(1)))
print(f"data: {repeat * len(coco['images'])} train / {len(coco['images'])} eval images in {dst}")
PY
visible=$(python3 -c "import torch; print(torch.cuda.device_count())")
for ngpu in ${NGPUS:-1 2}; do
  if [ "$ngpu" -gt "$visible" ]; then echo "skip NGPU=$ngpu: $visible GPU(s) visible"; continue; fi
  run="$WORK/run-${ngpu}gpu"
  rm -rf "$run"
  echo "=== NGPU=$ngpu: $STEPS steps, micro-batch $MB per GPU"
  NGPU=$ngpu timeout "${MAX_S:-200}" bash "$ROOT/recipes/retinanet-ddp/launch.sh" output_dir="$run" \
    run_name="bench-${ngpu}gpu" mlflow=false "data.train_images=$WORK/data/images" "data.train_annotations=$WORK/data/train.json" \
    "data.eval_images=$WORK/data/images" "data.eval_annotations=$WORK/data/eval.json" data.num_workers=${WORKERS:-6} \
    train.micro_batch_size=$MB train.max_steps=$STEPS train.epochs=1 train.log_every=10 train.eval_every=0 \
    optim.lr=1e-4 optim.warmup_ratio=0.05 checkpoint.every_steps=-1 checkpoint.resume=none "$@" \
    || echo "NGPU=$ngpu: exit status $? (124: stopped by MAX_S)"
  cp "$run/metrics.jsonl" "$OUT/metrics-${ngpu}gpu.jsonl" 2>/dev/null || true
  python3 - "$run/metrics.jsonl" "$ngpu" "$OUT/retinanet_ddp.jsonl" <<'PY'
import json, sys
from pathlib import Path
path, ngpu, out = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
rows = [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.exists() else []
train = [r for r in rows if r["event"] == "train" and r["step"] > 20]
evals = [r for r in rows if r["event"] == "eval"]
rec = {"ngpu": ngpu, "steps": max((r["step"] for r in rows if r["event"] == "train"), default=0),
       "images_per_s_per_gpu": sum(r["samples_per_s_per_device"] for r in train) / len(train) if train else None,
       "mem_allocated_gib": max((r.get("mem_allocated_gib", 0) for r in train), default=None),
       "map": evals[-1]["eval/map"] if evals else None, "map_50": evals[-1]["eval/map_50"] if evals else None}
print(json.dumps(rec))
with open(out, "a") as f:
    f.write(json.dumps(rec) + "\n")
PY
done
