"""The reference of benchmarks/modernbert_vs_hf_trainer.sh: the same job as recipes/modernbert-ddp through the Hugging
Face Trainer, as its documentation writes it (datasets CSV, tokenizer map, DataCollatorWithPadding, Trainer.train,
Trainer.predict), on one GPU.

    python benchmarks/modernbert_hf_trainer.py --model DIR --train train.csv --eval heldout.csv --out RUN \\
        [--epochs 3] [--batch 64] [--max-length 256] [--attn sdpa_padsafe]

DIR: a ModernBERT config.json and tokenizer (random init, seed 42). CSVs with the header ``text,label`` (0-3).
The recipe's optimizer settings: AdamW (fused) lr 5e-5, weight decay 0.01, betas (0.9, 0.98), eps 1e-6, linear
schedule with 6% warm-up, clipping at 1.0, bf16, 2 loader workers. Attention: the recipe's ``sdpa_padsafe``
(registered by recipes/modernbert-ddp/train.py's register_attention), as plain ``sdpa`` gives NaN gradients on padded batches
(all-masked sliding-window rows; benchmarks/modernbert_attention.py); ``--attn sdpa``/``eager`` for the others.
Prints one JSON line and writes it to ``RUN/result.json``: ``first_step_s`` (process start to the end of step 1),
``train_samples_per_s`` (Trainer's), ``steady_samples_per_s`` (steps after the first 10), ``accuracy`` and
``macro_f1`` on the held-out rows, ``nonfinite_grad_logs`` (logged grad norms that were NaN/inf), ``wall_s``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path

import psutil

# the launch: the caller's clock (BENCH_T0, as the recipe's COOKBOOK_LAUNCH_TIME), else this process's start
START = float(os.environ.get("BENCH_T0") or psutil.Process().create_time())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for a in ("--model", "--train", "--eval", "--out"):
        p.add_argument(a, required=True)
    p.add_argument("--epochs", type=float, default=3)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--attn", default="sdpa_padsafe", choices=["sdpa_padsafe", "sdpa", "eager"])
    a = p.parse_args()

    if a.attn == "sdpa_padsafe":  # the recipe's register_attention adds it to transformers' AttentionInterface
        root = Path(__file__).resolve().parents[1]
        sys.path.insert(0, str(root / "shared"))
        spec = importlib.util.spec_from_file_location("modernbert_ddp_train", root / "recipes/modernbert-ddp/train.py")
        sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclasses look their module up
        spec.loader.exec_module(sys.modules[spec.name])
        sys.modules[spec.name].register_attention()

    import numpy as np
    import torch
    from datasets import load_dataset
    from transformers import (
        AutoConfig,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    ds = load_dataset("csv", data_files={"train": a.train, "eval": a.eval})
    tok = AutoTokenizer.from_pretrained(a.model)
    ds = ds.map(
        lambda b: tok(b["text"], truncation=True, max_length=a.max_length), batched=True, remove_columns=["text"]
    )
    torch.manual_seed(42)
    model = AutoModelForSequenceClassification.from_config(
        AutoConfig.from_pretrained(a.model, num_labels=4, attn_implementation=a.attn)
    )
    steps = int(a.epochs * (len(ds["train"]) // a.batch + (len(ds["train"]) % a.batch > 0)))
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times.append(time.time())

    args = TrainingArguments(
        a.out,
        per_device_train_batch_size=a.batch,
        per_device_eval_batch_size=2 * a.batch,
        num_train_epochs=a.epochs,
        learning_rate=5e-5,
        weight_decay=0.01,
        adam_beta1=0.9,
        adam_beta2=0.98,
        adam_epsilon=1e-6,
        lr_scheduler_type="linear",
        warmup_steps=int(0.06 * steps),
        max_grad_norm=1.0,
        bf16=torch.cuda.is_available(),
        optim="adamw_torch_fused",
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        logging_steps=50,
        dataloader_num_workers=2,
        seed=42,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=ds["train"],
        data_collator=DataCollatorWithPadding(tok, pad_to_multiple_of=8),
        callbacks=[Clock()],
    )
    out = trainer.train()
    pred = trainer.predict(ds["eval"])
    labels, guess = pred.label_ids, pred.predictions.argmax(-1)
    f1 = [2 * ((guess == c) & (labels == c)).sum() / max((guess == c).sum() + (labels == c).sum(), 1) for c in range(4)]
    gaps = np.diff(times[10:])
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    r = {
        "path": "hf_trainer",
        "attn_implementation": a.attn,
        "first_step_s": times[0] - START,
        "steps": len(times),
        "train_samples_per_s": out.metrics["train_samples_per_second"],
        "steady_samples_per_s": a.batch / float(np.median(gaps)) if len(gaps) else None,
        "nonfinite_grad_logs": sum(not math.isfinite(g) for g in norms),
        "grad_logs": len(norms),
        "accuracy": float((labels == guess).mean()),
        "macro_f1": float(np.mean(f1)),
        "eval_rows": int(len(labels)),
        "wall_s": time.time() - START,
        "peak_alloc_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
    }
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "result.json").write_text(json.dumps(r))
    print(json.dumps(r))


if __name__ == "__main__":
    main()
