#!/usr/bin/env bash
# GPT-OSS 20B LoRA through recipes/gpt-oss-lora-trl/train.py (TRL SFTTrainer + PEFT, DDP) on this machine's GPUs:
# tokens/s/GPU, MFU on active parameters and peak memory, from the run's metrics.jsonl (benchmarks/summarize.py).
#   - Model: the gpt_oss 20B architecture (GptOssConfig with 24 layers and 32 experts, 4 per token; its defaults:
#     hidden 2880, 64 heads / 8 kv of 64, sliding window 128 on alternate layers, YaRN x32 over 4096, vocab 201,088)
#     with random weights in bf16 (model.pretrained=false): no hub here, so not openai/gpt-oss-20b's weights.
#   - Tokenizer: the o200k tokenizer of gpt-oss is not offline here; .data/qwen3's tokenizer (151,643 tokens) with the
#     harmony special tokens added and the recipe's tiny harmony chat template (tiny/gpt_oss/chat_template.jinja),
#     built at run time. The vocab (201,088 rows) covers it.
#   - Data: .data/alpaca_data_sample5000.json, consecutive rows joined into one user turn (the prompts) and one
#     assistant turn (the answers) of more than SEQ tokens together, cut at SEQ; micro-batch MB, no packing.
#   - Runs (RUNS): by default (a) no activation checkpointing, (b) train.activation_checkpointing=full;
#     flex_attention; STEPS steps each; no checkpoints and no export (a merged 20B export is 40 GB of disk).
#   bash benchmarks/gpt_oss_lora.sh                              # on the device, from the repository root
#   NGPU=2 STEPS=30 OUT=/tmp/out bash benchmarks/gpt_oss_lora.sh
#   FSDP=1 bash benchmarks/gpt_oss_lora.sh                      # also (c) parallel=fsdp (+ full AC)
#   RUNS="noac:none:1 mb2:none:2 experts:experts:1 fsdp:full:1:parallel=fsdp" bash benchmarks/gpt_oss_lora.sh
#     (name:activation_checkpointing:micro_batch[:override,...]; AC_STEPS steps for the full-checkpointing runs)
#   CPU check of this code path: TINY=1 SKIP_INSTALL=1 bash benchmarks/gpt_oss_lora.sh
# Writes $OUT/results.jsonl (one record per run, or its error) and $OUT/<run>.log (each run's last lines).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT=${OUT:-outputs/bench-gpt-oss}
mkdir -p "$OUT"
WORK=${RUNS_DIR:-/tmp/bench-gpt-oss}
STEPS=${STEPS:-35}
SKIP_STEPS=${SKIP_STEPS:-5}
SEQ=${SEQ:-4096}
MB=${MB:-1}
RUN_TIMEOUT=${RUN_TIMEOUT:-200}             # seconds per run, model build included (2 runs + setup < 10 min)
TINY=${TINY:-0}                              # 1: the tiny gpt_oss (CPU check of this script)
RESULTS="$OUT/results.jsonl"
: > "$RESULTS"
say() { echo "$(date -u +%H:%M:%S) $*"; }

if [[ "${SKIP_INSTALL:-0}" == 0 ]]; then
  say "installing .whl/*.whl into /tmp/site"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo '{"run": "setup", "error": "pip install of .whl failed"}' >> "$RESULTS"; exit 1; }
  export PYTHONPATH=/tmp/site:$ROOT/shared
else
  export PYTHONPATH=${PYTHONPATH:-$ROOT/shared}
fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TQDM_DISABLE=1 TOKENIZERS_PARALLELISM=false
NGPU=${NGPU:-$(python3 -c 'import torch; print(torch.cuda.device_count() or 1)')}
rm -rf "$WORK"
mkdir -p "$WORK"
say "building the model config, the tokenizer and $WORK/rows.jsonl"
python3 - "$WORK" "$SEQ" "$TINY" "$((STEPS * ${MAX_MB:-4} * NGPU + 16))" <<'EOF' || { echo '{"run": "setup", "error": "data/model preparation failed"}' >> "$RESULTS"; exit 1; }
import importlib, json, sys
from pathlib import Path
import torch
from transformers import AutoConfig, GptOssConfig, PreTrainedTokenizerFast

runs, seq, tiny, n_rows = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
for m in ("transformers", "peft", "trl", "datasets", "accelerate", "torch"):
    print(m, importlib.import_module(m).__version__, flush=True)
print("cuda", torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU", flush=True)
recipe = Path("recipes/gpt-oss-lora-trl")
harmony = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>", "<|constrain|>"]
tok = PreTrainedTokenizerFast(tokenizer_file=".data/qwen3/tokenizer.json", clean_up_tokenization_spaces=False)
tok.add_special_tokens({"additional_special_tokens": harmony, "pad_token": "<|endoftext|>", "eos_token": "<|return|>"})
tok.chat_template = (recipe / "tiny/gpt_oss/chat_template.jinja").read_text()
model = runs / "model"
tok.save_pretrained(model)
if tiny:
    cfg = AutoConfig.from_pretrained(recipe / "tiny/gpt_oss")
    cfg.vocab_size = -(-len(tok) // 64) * 64
else:
    # gpt-oss-20b's architecture (its config.json): GptOssConfig's defaults are 120B's (36 layers, 128 experts)
    cfg = GptOssConfig(num_hidden_layers=24, num_local_experts=32, num_experts_per_tok=4,
                       layer_types=["sliding_attention", "full_attention"] * 12)
cfg.pad_token_id, cfg.eos_token_id = tok.pad_token_id, tok.eos_token_id
assert len(tok) <= cfg.vocab_size, (len(tok), cfg.vocab_size)
cfg.save_pretrained(model)
print(f"model: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.num_local_experts} experts "
      f"({cfg.num_experts_per_tok} per token), heads {cfg.num_attention_heads}/{cfg.num_key_value_heads} x "
      f"{cfg.head_dim}, vocab {cfg.vocab_size}, sliding window {cfg.sliding_window}, rope {cfg.rope_parameters}; "
      f"tokenizer {len(tok)} tokens", flush=True)
with torch.device("meta"):
    from transformers import AutoModelForCausalLM
    meta = AutoModelForCausalLM.from_config(cfg)
experts = sum(p.numel() for n, p in meta.named_parameters() if ".mlp.experts." in n)
total = sum(p.numel() for p in meta.parameters())
print(f"parameters: {total / 1e9:.2f} B in all, {(total - experts * (1 - cfg.num_experts_per_tok / cfg.num_local_experts)) / 1e9:.2f} B "
      f"active per token (embeddings included)", flush=True)
# One user turn (consecutive Alpaca prompts) and one assistant turn (their answers) of about SEQ tokens together: the
# recipe trains each assistant turn as an example of its own (harmony drops earlier turns' reasoning), so a
# multi-turn row would give examples of every length, not SEQ-token steps.
rows, prompts, answers, est = [], [], [], 0
for r in json.load(open(".data/alpaca_data_sample5000.json")):
    prompt = r["instruction"] + (f"\n\n{r['input']}" if r.get("input", "").strip() else "")
    if not r["output"].strip():
        continue
    prompts.append(prompt)
    answers.append(r["output"])
    est += len(tok.encode(prompt + r["output"])) + 4
    if est >= seq + 64:
        rows.append({"messages": [{"role": "user", "content": "\n\n".join(prompts)},
                                  {"role": "assistant", "content": "\n\n".join(answers)}]})
        prompts, answers, est = [], [], 0
        if len(rows) == n_rows:
            break
with open(runs / "rows.jsonl", "w") as f:
    f.writelines(json.dumps(row) + "\n" for row in rows)
print(f"{len(rows)} conversations of ~{seq} tokens", flush=True)
EOF

if [[ "$TINY" == 1 ]]; then attn=eager; else attn=flex_attention; fi
common=("model.name_or_path=$WORK/model" model.pretrained=false "model.attn_implementation=$attn"
        "data.train_files=[$WORK/rows.jsonl]" "data.max_length=$SEQ" data.chat_template_kwargs={}
        "train.micro_batch_size=$MB" train.grad_accum_steps=1 "train.max_steps=$STEPS" train.log_every=1
        checkpoint.every_steps=-1 checkpoint.export_hf=false mlflow=false trackers=[])

run() {  # name activation_checkpointing [more overrides]
  local name=$1 ac=$2 rc
  shift 2
  say "[$name] $STEPS steps on $NGPU GPU(s), micro-batch $MB x $SEQ tokens, activation checkpointing $ac (at most ${RUN_TIMEOUT}s)"
  timeout --signal=TERM --kill-after=20 "$RUN_TIMEOUT" \
    torchrun --standalone --nproc-per-node "$NGPU" recipes/gpt-oss-lora-trl/train.py \
      --config recipes/gpt-oss-lora-trl/config.yaml "output_dir=$WORK/$name" "run_name=bench-gpt-oss-$name" \
      "train.activation_checkpointing=$ac" "${common[@]}" "train.max_steps=$STEPS" "$@" > "$WORK/$name.log" 2>&1
  rc=$?
  tail -n 40 "$WORK/$name.log" > "$OUT/$name.log"
  if [[ $rc -eq 0 ]]; then
    python3 benchmarks/summarize.py --skip-steps "$SKIP_STEPS" --json "$WORK/$name.json" "$WORK/$name" > /dev/null \
      && python3 -c "import json,sys; r=json.loads(open(sys.argv[1]).readline()); r.update(run=sys.argv[2], activation_checkpointing=sys.argv[3], gpus=int(sys.argv[4]), seq=int(sys.argv[5]), micro_batch=int(sys.argv[6])); print(json.dumps(r))" \
         "$WORK/$name.json" "$name" "$ac" "$NGPU" "$SEQ" "$MB" >> "$RESULTS" \
      || echo "{\"run\": \"$name\", \"error\": \"summarize.py failed\"}" >> "$RESULTS"
  else
    python3 -c "import json,sys; print(json.dumps({'run': sys.argv[1], 'exit_status': int(sys.argv[2]), 'error': sys.argv[3]}))" \
      "$name" "$rc" "$(grep -E 'Error|error' "$WORK/$name.log" | tail -n 3 | tr '\n' ' ' | cut -c1-600)" >> "$RESULTS"
  fi
  say "[$name] exit status $rc"
}

# RUNS: name:activation_checkpointing:micro_batch[:override,override...]; each run STEPS steps (ac=full: AC_STEPS)
RUNS_LIST=${RUNS:-"noac:none:$MB ac:full:$MB"}
[[ "${FSDP:-0}" != 0 ]] && RUNS_LIST="$RUNS_LIST fsdp:full:$MB:parallel=fsdp"  # the recipe's 120B path on this model
names=()
for spec in $RUNS_LIST; do
  IFS=: read -r name ac mb extra <<< "$spec"
  names+=("$name")
  steps=$STEPS; [[ "$ac" == full ]] && steps=${AC_STEPS:-$STEPS}
  MB=$mb STEPS=$steps run "$name" "$ac" "train.micro_batch_size=$mb" ${extra:+${extra//,/ }}
done
say "results ($RESULTS):"
cat "$RESULTS"
python3 benchmarks/summarize.py --skip-steps "$SKIP_STEPS" $(for r in "${names[@]}"; do [[ -f "$WORK/$r/metrics.jsonl" ]] && echo "$WORK/$r"; done) || true
