"""Write the Axolotl run of `benchmarks/unsloth_axolotl_vs_trl.sh`: its data, its random-init model if the TRL path
left none, and the YAML with the TRL path's settings (recipes/unsloth-lora-ddp/config.yaml and the script's overrides).

    python benchmarks/axolotl_bench_config.py --model DIR --rows alpaca_data_sample5000.json --run-dir RUN \\
        --seq 2048 --steps 40 [--init-from CONFIG_DIR] [--cpu] [--no-lora-kernels] [--adapter qlora]
        [--prepared DIR] [--packing]
    python benchmarks/axolotl_bench_config.py --init-only --model DIR --init-from CONFIG_DIR [--cpu]

``--init-from``: when ``--model`` holds no ``config.json``, build ``CONFIG_DIR``'s architecture with random weights
(``torch.manual_seed(42)``, bf16 on a GPU, fp32 with ``--cpu``; as train.py's ``model.pretrained=false``) and save it
and ``CONFIG_DIR``'s tokenizer to ``--model``; ``--init-only`` does only that (on the GPU when there is one). Writes ``RUN/data/chat.jsonl`` (recipes/axolotl-lora-ddp/prepare_data.py's
conversion) and ``RUN/axolotl.yaml``; prints the YAML's path. Exit status 2 with one line on a row or file that cannot
be read. ``--adapter qlora``: the same run on a 4-bit NF4 base (bitsandbytes; ``load_in_4bit``, Axolotl's defaults
for the quantization: bf16 compute, double quantization), as recipes/axolotl-lora-ddp/qlora.yaml. ``--prepared``:
Axolotl's prepared data set folder (default ``RUN/prepared``), shared by runs of the same data and tokenizer.
On a GPU with the kernels on, `attn_kernels_apply` checks whether Axolotl's LoRA QKV/O kernels can patch the model's
attention; where they cannot (OLMo-3), the YAML turns those two off and keeps the MLP kernel.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def axolotl_config(
    model: str,
    data: str,
    run_dir: str,
    seq: int,
    steps: int,
    cpu: bool,
    pad_token: str | None,
    lora_kernels: bool = True,
    adapter: str = "lora",
    prepared: str | None = None,
    attn_kernels: bool = True,
    packing: bool = False,
) -> dict:
    """The Axolotl config (a dict for `yaml.safe_dump`) of the benchmark's LoRA run.

    Args:
        model: the checkpoint folder (weights, config.json, tokenizer), used as ``base_model`` and tokenizer.
        data: chat JSONL (``{"messages": [...]}`` rows).
        run_dir: where Axolotl writes its prepared data set and outputs (``<run_dir>/<its name>/``, with
            ``metrics.jsonl``, so that benchmarks/summarize.py names the run as the folder).
        seq: ``sequence_len`` (tokens); unpacked rows: each batch padded to its longest row.
        steps: ``max_steps``.
        cpu: fp32 and Axolotl's LoRA Triton kernels off (they need a GPU); else bf16 and the kernels left to
            Axolotl's default (on for single-GPU LoRA).
        pad_token: the pad token to set (the EOS token, as train.py does) when the tokenizer has none; ``None``
            keeps the tokenizer's.
        lora_kernels: ``False`` turns Axolotl's LoRA Triton kernels off on a GPU too.
        adapter: ``lora`` (16-bit base) or ``qlora`` (4-bit NF4 base through bitsandbytes, ``load_in_4bit``).
        prepared: Axolotl's ``dataset_prepared_path``; ``None``: ``<run_dir>/prepared``.
        attn_kernels: ``False`` (a model whose attention Axolotl's QKV/O kernels cannot patch, see
            `attn_kernels_apply`): ``lora_qkv_kernel`` and ``lora_o_kernel`` off and ``lora_mlp_kernel`` on (Axolotl
            turns all three on only when none is set); with `cpu` or not `lora_kernels` all stay off.
        packing: ``sample_packing`` (rows packed into ``seq``-token bins, as TRL's ``packing``), each bin padded to
            ``seq``, ``attn_implementation: sdpa`` (packed documents through ``varlen_attn``: no attention
            across them).

    Raises:
        ValueError: `adapter` is neither ``lora`` nor ``qlora``.
    """
    if adapter not in ("lora", "qlora"):
        raise ValueError(f"adapter must be lora or qlora, got {adapter!r}")
    cfg = {
        "base_model": model,
        "tokenizer_config": model,
        "trust_remote_code": False,
        "adapter": adapter,
        "lora_r": 16,
        "lora_alpha": 32,
        "lora_dropout": 0.0,
        "lora_target_modules": LORA_MODULES,
        "chat_template": "tokenizer_default",
        "datasets": [
            {
                "path": data,
                "ds_type": "json",
                "type": "chat_template",
                "field_messages": "messages",
                "roles_to_train": ["assistant"],
                "train_on_eos": "turn",
            }
        ],
        "dataset_prepared_path": prepared or f"{run_dir}/prepared",
        "dataset_num_proc": 1,
        "val_set_size": 0.0,
        "sequence_len": seq,
        "sample_packing": False,
        "pad_to_sequence_len": False,
        "micro_batch_size": 4,
        "gradient_accumulation_steps": 1,
        "max_steps": steps,
        "learning_rate": 2.0e-4,
        "warmup_steps": 10,
        "lr_scheduler": "cosine",
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "optimizer": "adamw_torch_fused",
        "seed": 42,
        "bf16": not cpu,
        "gradient_checkpointing": True,
        "gradient_checkpointing_kwargs": {"use_reentrant": False},
        "dataloader_num_workers": 1,
        "logging_steps": 1,
        "save_strategy": "no",
        "output_dir": f"{run_dir}/{Path(run_dir).name}",
        "plugins": ["cookbook_metrics.CookbookMetricsPlugin"],
    }
    if packing:
        cfg.update(sample_packing=True, pad_to_sequence_len=True, attn_implementation="sdpa")
    if adapter == "qlora":
        cfg["load_in_4bit"] = True
    if pad_token is not None:
        cfg["special_tokens"] = {"pad_token": pad_token}
    if cpu or not lora_kernels:
        cfg.update(lora_qkv_kernel=False, lora_o_kernel=False, lora_mlp_kernel=False)
    elif not attn_kernels:
        cfg.update(lora_qkv_kernel=False, lora_o_kernel=False, lora_mlp_kernel=True)
    return cfg


def attn_kernels_apply(model_dir: str) -> tuple[bool, str]:
    """Whether Axolotl's LoRA QKV/O kernels can patch the attention of `model_dir`'s architecture: runs Axolotl's
    own source rewrite (``axolotl.monkeypatch.lora_kernels.patch_self_attn_lora``, in this process only), which
    asserts that the attention forward holds the projection code it replaces (OLMo-3's
    ``self.q_norm(self.q_proj(hidden_states))`` is not that code in Axolotl 0.19.0). Returns (applies, reason).
    Needs Axolotl importable."""
    from axolotl.monkeypatch.lora_kernels import patch_self_attn_lora
    from axolotl.utils.dict import DictDefault
    from transformers import AutoConfig

    model_type = AutoConfig.from_pretrained(model_dir).model_type
    try:
        patch_self_attn_lora(
            DictDefault(base_model=model_dir, model_config_type=model_type, lora_qkv_kernel=True, lora_o_kernel=True)
        )
    except (AssertionError, ValueError) as exc:
        return False, f"{model_type}: {exc}"
    return True, model_type


def save_random_init(config_dir: str, model_dir: str, cpu: bool) -> None:
    """Save `config_dir`'s architecture with random weights (seed 42; built on the GPU in bf16 when there is one and
    not `cpu`, else on the CPU, fp32 with `cpu`) and its tokenizer to `model_dir`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(42)
    dtype = torch.float32 if cpu else torch.bfloat16
    device = "cuda" if not cpu and torch.cuda.is_available() else "cpu"  # a 7B init takes minutes on the CPU
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=dtype)
    model.save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(config_dir).save_pretrained(model_dir)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--init-only", action="store_true")
    p.add_argument("--rows")
    p.add_argument("--run-dir")
    p.add_argument("--seq", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--init-from", default=None)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--no-lora-kernels", action="store_true")
    p.add_argument("--adapter", choices=("lora", "qlora"), default="lora")
    p.add_argument("--prepared", default=None)
    p.add_argument("--packing", action="store_true")
    a = p.parse_args(argv)
    if a.init_only:
        if a.init_from is None:
            p.error("--init-only needs --init-from")
        save_random_init(a.init_from, str(Path(a.model).resolve()), a.cpu)
        print(f"{a.model}: random init of {a.init_from}")
        return 0
    missing = [f"--{k.replace('_', '-')}" for k in ("rows", "run_dir", "seq", "steps") if getattr(a, k) is None]
    if missing:
        p.error(f"the following arguments are required: {', '.join(missing)}")
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
    attn, why = True, ""
    if not (a.cpu or a.no_lora_kernels):
        attn, why = attn_kernels_apply(model)
    cfg = axolotl_config(
        model,
        str(data),
        str(run),
        a.seq,
        a.steps,
        a.cpu,
        pad,
        not a.no_lora_kernels,
        a.adapter,
        a.prepared and str(Path(a.prepared).resolve()),
        attn,
        a.packing,
    )
    path = run / "axolotl.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    print(f"{path} ({n} conversations of {a.rows}; pad token {pad or tok.pad_token!r})")
    if not attn:
        print(
            f"Axolotl's LoRA QKV/O kernels do not apply ({why}): lora_qkv_kernel/lora_o_kernel false, "
            f"lora_mlp_kernel true"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
