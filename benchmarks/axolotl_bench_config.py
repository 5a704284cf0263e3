"""Write the Axolotl run of `benchmarks/unsloth_axolotl_vs_trl.sh`: its data, its random-init model if the TRL path
left none, and the YAML with the TRL path's settings (recipes/unsloth-lora-ddp/config.yaml and the script's overrides).

    python benchmarks/axolotl_bench_config.py --model DIR --rows alpaca_data_sample5000.json --run-dir RUN \\
        --seq 2048 --steps 40 [--init-from CONFIG_DIR] [--cpu] [--no-lora-kernels]

``--init-from``: when ``--model`` holds no ``config.json``, build ``CONFIG_DIR``'s architecture with random weights
(``torch.manual_seed(42)``, bf16 on a GPU, fp32 with ``--cpu``; as train.py's ``model.pretrained=false``) and save it
and ``CONFIG_DIR``'s tokenizer to ``--model``. Writes ``RUN/data/chat.jsonl`` (recipes/axolotl-lora-ddp/prepare_data.py's
conversion) and ``RUN/axolotl.yaml``; prints the YAML's path. Exit status 2 with one line on a row or file that cannot
be read.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def axolotl_config(model: str, data: str, run_dir: str, seq: int, steps: int, cpu: bool,
                   pad_token: str | None, lora_kernels: bool = True) -> dict:
    """The Axolotl config (a dict for `yaml.safe_dump`) of the benchmark's LoRA run.

    Args:
        model: the checkpoint folder (weights, config.json, tokenizer), used as ``base_model`` and tokenizer.
        data: chat JSONL (``{"messages": [...]}`` rows).
        run_dir: where Axolotl writes its prepared data set and outputs (``axolotl/``, with ``metrics.jsonl``).
        seq: ``sequence_len`` (tokens); rows are not packed and each batch is padded to its longest row.
        steps: ``max_steps``.
        cpu: fp32 and Axolotl's LoRA Triton kernels off (they need a GPU); else bf16 and the kernels left to
            Axolotl's default (on for single-GPU LoRA).
        pad_token: the pad token to set (the EOS token, as train.py does) when the tokenizer has none; ``None``
            keeps the tokenizer's.
        lora_kernels: ``False`` turns Axolotl's LoRA Triton kernels off on a GPU too.
    """
    cfg = {
        "base_model": model, "tokenizer_config": model, "trust_remote_code": False,
        "adapter": "lora", "lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "lora_target_modules": LORA_MODULES,
        "chat_template": "tokenizer_default",
        "datasets": [{"path": data, "ds_type": "json", "type": "chat_template", "field_messages": "messages",
                      "roles_to_train": ["assistant"], "train_on_eos": "turn"}],
        "dataset_prepared_path": f"{run_dir}/prepared", "dataset_num_proc": 1, "val_set_size": 0.0,
        "sequence_len": seq, "sample_packing": False, "pad_to_sequence_len": False,
        "micro_batch_size": 4, "gradient_accumulation_steps": 1, "max_steps": steps,
        "learning_rate": 2.0e-4, "warmup_steps": 10, "lr_scheduler": "cosine", "weight_decay": 0.0,
        "max_grad_norm": 1.0, "optimizer": "adamw_torch_fused", "seed": 42,
        "bf16": not cpu, "gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False},
        "dataloader_num_workers": 1, "logging_steps": 1, "save_strategy": "no", "output_dir": f"{run_dir}/axolotl",
        "plugins": ["cookbook_metrics.CookbookMetricsPlugin"],
    }
    if pad_token is not None:
        cfg["special_tokens"] = {"pad_token": pad_token}
    if cpu or not lora_kernels:
        cfg.update(lora_qkv_kernel=False, lora_o_kernel=False, lora_mlp_kernel=False)
    return cfg


def save_random_init(config_dir: str, model_dir: str, cpu: bool) -> None:
    """Save `config_dir`'s architecture with random weights (seed 42) and its tokenizer to `model_dir`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(42)
    dtype = torch.float32 if cpu else torch.bfloat16
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=dtype).save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(config_dir).save_pretrained(model_dir)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--rows", required=True)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--seq", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--init-from", default=None)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--no-lora-kernels", action="store_true")
    a = p.parse_args(argv)
    import yaml
    from transformers import AutoTokenizer

    sys.path.insert(0, str(ROOT / "recipes" / "axolotl-lora-ddp"))
    from prepare_data import convert

    from cookbook import sft

    run = Path(a.run_dir).resolve()
    model = str(Path(a.model).resolve())
    if not (Path(model) / "config.json").is_file():
        if a.init_from is None:
            print(f"error: {model} has no config.json (and no --init-from)", file=sys.stderr)
            return 2
        save_random_init(a.init_from, model, a.cpu)
    data = run / "data" / "chat.jsonl"
    try:
        n = convert(a.rows, str(data))
    except sft.SFTDataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    tok = AutoTokenizer.from_pretrained(model)
    pad = tok.eos_token if tok.pad_token is None else None
    cfg = axolotl_config(model, str(data), str(run), a.seq, a.steps, a.cpu, pad, not a.no_lora_kernels)
    path = run / "axolotl.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    print(f"{path} ({n} conversations of {a.rows}; pad token {pad or tok.pad_token!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
