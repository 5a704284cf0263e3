"""Reference point for the SFT recipes: the usual library path, TRL's ``SFTTrainer`` with DeepSpeed
ZeRO-3 and library defaults (packing, gradient checkpointing, bf16), measured with the same
`cookbook.metrics.MetricsLogger` as the recipes so the numbers compare one to one.

    torchrun --standalone --nproc-per-node 2 benchmarks/trl_zero3_reference.py \
        --model-dir <folder with config.json + tokenizer> --train-file alpaca_data.json \
        --seq 2048 --micro-batch 4 --steps 10 --out outputs/bench-trl-zero3

The model is randomly initialised from ``config.json`` (under ``deepspeed.zero.Init``, so no rank
holds it whole); rows are chat / Alpaca / ShareGPT (``cookbook.sft.to_messages``; rows with an
empty answer are skipped). Writes ``<out>/metrics.jsonl``, which ``benchmarks/summarize.py`` reads.
"""

from __future__ import annotations

import argparse
import time

import deepspeed
import torch
from datasets import Dataset
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import SFTConfig, SFTTrainer

import cookbook
from cookbook import sft
from cookbook.metrics import MetricsLogger, ModelFlops, count_parameters

ZERO3 = {  # DeepSpeed's documented ZeRO-3 settings; "auto" values come from the trainer's arguments
    "bf16": {"enabled": "auto"},
    "zero_optimization": {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
}


class _Metrics(TrainerCallback):
    """Feeds the trainer's steps to a `MetricsLogger` (one record per optimizer step)."""

    def __init__(self, metrics: MetricsLogger):
        self.metrics, self.last_loss = metrics, torch.zeros(())

    def on_train_begin(self, args, state, control, **kwargs):
        self.metrics.start(state.global_step)

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        lr = optimizer.param_groups[0]["lr"] if optimizer is not None else 0.0
        self.metrics.log_step(state.global_step, self.last_loss, lr, None)


class CountingSFTTrainer(SFTTrainer):
    """`SFTTrainer` that counts the real tokens of each micro-batch for the metrics."""

    def __init__(self, *args, metrics_cb: _Metrics, micro_batch: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.metrics_cb, self.micro_batch = metrics_cb, micro_batch

    def training_step(self, model, inputs, num_items_in_batch=None):
        mask = inputs.get("attention_mask")
        tokens = mask.sum() if mask is not None else inputs["input_ids"].numel()  # padding-free: no pad
        # Padding-free packing puts the micro-batch in one row: count it as micro_batch rows for
        # the attention term of the FLOPs (seq = tokens / rows).
        self.metrics_cb.metrics.add(samples=self.micro_batch, tokens=tokens, data_wait_s=0.0)
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.metrics_cb.last_loss = loss.detach()
        return loss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", required=True, help="folder with config.json and the tokenizer files")
    p.add_argument("--train-file", required=True)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", default="outputs/bench-trl-zero3")
    p.add_argument("--no-gradient-checkpointing", action="store_true")
    a = p.parse_args()

    info = cookbook.init_distributed()  # before the trainer: DeepSpeed and accelerate reuse this group
    deepspeed.init_distributed(dist_backend=info.backend)  # zero.Init (in from_config) reads its world size
    on_gpu = info.device.type == "cuda"
    tokenizer = AutoTokenizer.from_pretrained(a.model_dir)
    rows = []
    for n, row in enumerate(sft.load_rows(a.train_file), 1):
        try:
            rows.append({"messages": sft.to_messages(row, n, a.train_file)})
        except sft.EmptyAnswerError:
            continue
    args = SFTConfig(  # created before the model: it switches on deepspeed.zero.Init for from_config
        output_dir=a.out,
        per_device_train_batch_size=a.micro_batch,
        gradient_accumulation_steps=1,
        max_steps=a.steps,
        learning_rate=1e-5,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, int(0.03 * a.steps)),
        max_grad_norm=1.0,
        bf16=on_gpu,
        use_cpu=not on_gpu,
        gradient_checkpointing=not a.no_gradient_checkpointing,
        max_length=a.seq,
        packing=True,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        deepspeed=ZERO3,
        dataloader_num_workers=1,
        seed=42,
    )
    config = AutoConfig.from_pretrained(a.model_dir)
    model = AutoModelForCausalLM.from_config(config)
    flops = ModelFlops(
        count_parameters(model),
        config.num_hidden_layers,
        config.num_attention_heads * getattr(config, "head_dim", config.hidden_size // config.num_attention_heads),
    )
    metrics = MetricsLogger(a.out, info, flops=flops, run_name="trl-zero3-reference", mlflow=False, max_steps=a.steps)
    cb = _Metrics(metrics)
    trainer = CountingSFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        callbacks=[cb],
        metrics_cb=cb,
        micro_batch=a.micro_batch,
    )
    t0 = time.perf_counter()
    trainer.train()
    metrics.log_summary({"step": a.steps, "wall_s": time.perf_counter() - t0})
    metrics.close()
    cookbook.destroy_distributed()


if __name__ == "__main__":
    main()
