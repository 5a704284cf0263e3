"""LoRA fine-tune of GPT-OSS (``gpt_oss``, a mixture-of-experts model) with TRL's SFTTrainer and PEFT, under torchrun.

    bash recipes/gpt-oss-lora-trl/launch.sh                                   # gpt-oss-20b, DDP on this node's GPUs
    CONFIG_FILE=gpt-oss-120b.yaml bash recipes/gpt-oss-lora-trl/launch.sh     # gpt-oss-120b, FSDP2 + activation ckpt
    NGPU=1 bash recipes/gpt-oss-lora-trl/launch.sh train.max_steps=50 lora.r=32
    CONFIG_FILE=tiny.yaml bash recipes/gpt-oss-lora-trl/launch.sh             # tiny twin, 2 CPU processes

``parallel`` is the one place the technique differs: ``ddp`` loads the whole model on each rank's GPU and the
Trainer wraps it in DistributedDataParallel; ``fsdp`` has the Trainer shard it with FSDP2 (one unit per
``GptOssDecoderLayer``) for 120B. Hub MXFP4 weights are loaded dequantized to bf16. Rows are rendered with the
harmony chat template, one example per final answer, labels on its final channel (`final_channel_labels`).
What it supports (weights, attention, data, checkpoints, failures): README.md beside this file.
"""

from __future__ import annotations

import os
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", message=".*set_vital.*")

import torch
from trl import SFTTrainer

import cookbook
from cookbook import config, hf_trainer, lm, sft
from cookbook.checkpoint import CheckpointError
from cookbook.config import ConfigError, check_fields, load_config
from cookbook.hub import resolve_path
from cookbook.loop import NonFinitePolicy

PARALLEL = ("ddp", "fsdp")
FINAL_START = "<|channel|>final<|message|>"  # the final channel's header; its text ends at <|return|> or <|end|>
ANALYSIS_START = "<|channel|>analysis<|message|>"  # the analysis channel's (an assistant turn's thinking)
FINAL_ENDS = ("<|return|>", "<|end|>")
COMPILE_BACKEND = "inductor"  # train.compile's (the CPU tests set aot_eager: inductor's C++ build is slow)
CANNOT_REMAP = "the Trainer's data order and per-rank RNG states depend on it"  # why a resume keeps the world size


# ----------------------------------------------------------------------------- config
@dataclass
class ModelConfig:
    name_or_path: str = "openai/gpt-oss-20b"  # hub id or local folder (config.json, *.safetensors, tokenizer)
    pretrained: bool = True  # false: random init from config.json (benchmarks, CI)
    tokenizer: str | None = None  # default: name_or_path
    attn_implementation: str = "flex_attention"  # flex_attention (GPU) or eager; sdpa is refused for gpt_oss


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)  # chat JSONL / JSON / parquet; empty: hub_id
    hub_id: str = "HuggingFaceH4/Multilingual-Thinking"
    max_length: int = 2048  # tokens per example; longer ones are cut (and dropped if no final-channel token is left)
    num_workers: int = 1
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. {reasoning_effort: medium}
    max_dropped_fraction: float = 0.1  # refuse when more of the rows are dropped (no final-channel token kept)
    reasoning: str = "context"  # an answer's thinking (analysis channel): context (rendered, no loss), train, drop


@dataclass
class OptimConfig(config.OptimConfig):
    optimizer: str = "adamw_torch_fused"  # a transformers `optim` name; "adamw_torch" on CPU
    lr: float = 2.0e-4


@dataclass
class TrainConfig(config.TrainConfig):
    micro_batch_size: int = 4
    max_steps: int = 200
    # none; experts (recompute only each layer's MoE block: router + experts; attention keeps its activations);
    # full (whole decoder layers; with parallel=fsdp: FSDP's own activation checkpointing)
    activation_checkpointing: str = "full"
    compile: bool = False  # torch.compile each decoder layer: its norms, rotary, router and LoRA matmuls fused


@dataclass
class Config(config.RunConfig):
    output_dir: str = "outputs/gpt-oss-20b-lora"
    run_name: str = "gpt-oss-20b-lora"
    parallel: str = "ddp"  # ddp (one model copy per GPU) or fsdp (FSDP2 shards, for 120B)
    model: ModelConfig = field(default_factory=ModelConfig)
    # r, alpha, dropout, target_modules (attention) and target_parameters (e.g. [mlp.experts.gate_up_proj,
    # mlp.experts.down_proj]; empty: no expert LoRA)
    lora: config.ExpertLoraConfig = field(default_factory=config.ExpertLoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: config.HFCheckpointConfig = field(default_factory=config.HFCheckpointConfig)


MAY_CHANGE = (
    *config.MAY_CHANGE,
    "data.num_workers",
    "data.max_dropped_fraction",
    "data.reasoning=context",
    "train.compile",
)


def check_config(cfg: Config, config_dir: Path, on_cpu: bool) -> None:
    """Resolve paths against the config file's folder and reject values that cannot work (before any worker).

    Raises:
        ConfigError: a value out of range or not one of its choices (naming the key; ``train.on_nonfinite`` and
            ``train.max_consecutive_skips`` too), ``sdpa`` attention,
            flex_attention or ``parallel=fsdp`` on CPU, no data source.
    """
    cfg.model.name_or_path = resolve_path(cfg.model.name_or_path, config_dir)
    cfg.model.tokenizer = resolve_path(cfg.model.tokenizer or cfg.model.name_or_path, config_dir)
    cfg.data.train_files = [resolve_path(f, config_dir) for f in cfg.data.train_files]
    config.check_run(cfg)
    NonFinitePolicy.settings(cfg.train)  # train.on_nonfinite, train.max_consecutive_skips
    check_fields(
        cfg,
        at_least={"data.max_length": 1, "lora.r": 1, "lora.alpha": 1},
        one_of={
            "parallel": PARALLEL,
            "train.activation_checkpointing": ("none", "experts", "full"),
            "data.reasoning": ("context", "train", "drop"),
            "model.attn_implementation": ("flex_attention", "eager"),
        },
        within={"lora.dropout": "[0, 1)", "data.max_dropped_fraction": "[0, 1]"},
        notes={"model.attn_implementation": "sdpa is refused by transformers for gpt_oss (attention sinks)"},
    )
    lm.check_attention(cfg.model.attn_implementation, on_cpu)
    if on_cpu and cfg.parallel == "fsdp":  # accelerate's MULTI_CPU: the Trainer would wrap the model in DDP
        raise ConfigError(
            "parallel=fsdp needs CUDA GPUs: on CPU the Trainer ignores its fsdp settings and runs DDP; "
            "use parallel=ddp on CPU"
        )
    if not cfg.lora.target_modules and not cfg.lora.target_parameters:
        raise ConfigError("lora.target_modules and lora.target_parameters are both empty: nothing to train")
    if not cfg.data.train_files and not cfg.data.hub_id:
        raise ConfigError("set data.train_files (chat JSONL files) or data.hub_id")


# ----------------------------------------------------------------------------- data
def harmony_conversation(row: dict, n: int | str, source: str, ignored=None) -> tuple[list[dict], list[dict] | None]:
    """One row as harmony messages and its tools: `cookbook.sft.to_conversation` (which checks the row, names
    ``<source> row <n>`` (or the label `n`, such as ``line 19``) in its errors and keeps an assistant turn's
    reasoning: ``thinking`` or ``reasoning_content``, put under ``thinking``, the template's field), with the
    ``developer`` role (checked as ``system``) put back.

    Raises:
        sft.SFTDataError: see `cookbook.sft.to_conversation`; an assistant turn with more than one tool call (the
            harmony template renders the first only).
    """
    turns = row.get("messages") if isinstance(row.get("messages"), list) else None
    if turns is not None:  # "developer" is a harmony role that to_conversation does not know: check it as system
        row = {
            **row,
            "messages": [
                {**t, "role": "system"} if isinstance(t, dict) and t.get("role") == "developer" else t for t in turns
            ],
        }
    messages, tools = sft.to_conversation(row, n, source, ignored)
    for i, m in enumerate(messages):
        if "reasoning_content" in m:
            m["thinking"] = m.pop("reasoning_content")
        if len(m.get("tool_calls", ())) > 1:
            raise sft.SFTDataError(
                f"{source} {sft.row_label(n)}: messages[{i}] has {len(m['tool_calls'])} tool calls, but the "
                f"harmony chat template renders only the first of a turn: give each call its own "
                f"assistant turn (each followed by its tool result)"
            )
    if turns is not None and len(turns) == len(messages):
        for turn, m in zip(turns, messages):
            if turn.get("role") == "developer":
                m["role"] = "developer"
    return messages, tools


def _spans(input_ids: list[int], tokenizer, header: str) -> list[tuple[int, int]]:
    """``(start, stop)`` of each message body after the token sequence `header`, through its closing
    ``<|return|>`` / ``<|end|>`` (inclusive; a body cut by truncation runs to the end)."""
    head = tokenizer.encode(header, add_special_tokens=False)
    ends = {tokenizer.convert_tokens_to_ids(t) for t in FINAL_ENDS}
    if tokenizer.unk_token_id in ends or None in ends or len(head) < 3:
        raise sft.SFTDataError(
            f"the tokenizer has no harmony tokens {header} / {' / '.join(FINAL_ENDS)}: use a "
            f"GPT-OSS (harmony) tokenizer"
        )
    spans, k, h = [], 0, len(head)
    while k < len(input_ids):
        if input_ids[k : k + h] == head:
            start = k = k + h
            while k < len(input_ids) and input_ids[k] not in ends:
                k += 1
            k = min(k + 1, len(input_ids))
            spans.append((start, k))
        else:
            k += 1
    return spans


def final_channel_labels(input_ids: list[int], tokenizer, last_only: bool = False, analysis: bool = False) -> list[int]:
    """Labels for `input_ids` that keep only the assistant's final-channel tokens, `sft.IGNORE_INDEX` elsewhere.

    A labelled span starts right after each ``<|channel|>final<|message|>`` token sequence and ends at the next
    ``<|return|>`` or ``<|end|>``, inclusive (the model learns to stop); a span cut by truncation runs to the end.
    Everything else (system, developer, user, tool text, the analysis and commentary channels, the headers) is
    -100. Robust to any harmony template: it looks at the rendered tokens, not at how the template was written.

    Args:
        last_only: label the last final answer only (`tokenize_rows`: one example per answer).
        analysis: label the analysis message just before that answer too (``data.reasoning=train``).

    Raises:
        sft.SFTDataError: the tokenizer lacks a harmony special token (not a GPT-OSS tokenizer).
    """
    labels = [sft.IGNORE_INDEX] * len(input_ids)
    finals = _spans(input_ids, tokenizer, FINAL_START)
    for start, stop in finals[-1:] if last_only else finals:
        labels[start:stop] = input_ids[start:stop]
    if analysis and finals:
        before = [sp for sp in _spans(input_ids, tokenizer, ANALYSIS_START) if sp[1] <= finals[-1][0]]
        if before and before[-1][1] > (finals[-2][1] if len(finals) > 1 else 0):
            labels[before[-1][0] : before[-1][1]] = input_ids[before[-1][0] : before[-1][1]]
    return labels


def _answers(messages: list[dict]) -> list[int]:
    """Indices of the assistant final answers (assistant turns without tool calls)."""
    return [i for i, m in enumerate(messages) if m["role"] == "assistant" and not m.get("tool_calls")]


def tokenize_rows(rows: list[dict], tokenizer, cfg: DataConfig, source: str) -> tuple[list[dict], sft.SFTStats]:
    """One example per final answer of each row: the conversation up to that answer rendered with the chat template
    (its ``reasoning_effort``, else ``data.chat_template_kwargs``'s), as the model sees it when it writes the answer
    (the harmony template renders the thinking of the last turn only, and ends it in ``<|return|>``); that answer's
    final channel is labelled (`final_channel_labels`), and with ``data.reasoning=train`` its analysis message too.
    Cut at ``max_length``.

    Counted in the statistics: examples cut, dropped (no label left after the cut), rows whose answer is empty, rows
    that end in a tool call with no answer after it (that part is not trained; a row with no answer at all is not
    kept), thinking the template leaves out (a tool call's, when an answer follows it) or that
    ``data.reasoning=drop`` removed, keys not used.

    Raises:
        sft.SFTDataError: a bad row (``<source> row <n>: ...``), a template that fails on it, more than
            ``max_dropped_fraction`` of the rows dropped.
    """
    stats = sft.SFTStats(
        source=source,
        max_length=cfg.max_length,
        truncate=True,
        rows=len(rows),
        lines=getattr(rows, "lines", None),
        reasoning=cfg.reasoning,
        unrendered_why="the harmony template drops a tool call's thinking when an answer follows it, "
        "as the model never sees it",
    )
    examples, ignored = [], Counter()
    for n, row in enumerate(rows, 1):
        try:
            messages, tools = harmony_conversation(row, stats.label(n), source, ignored)
        except sft.EmptyAnswerError:
            stats.empty_answers.append(n)
            continue
        ignored.update(
            k
            for k in row
            if k
            not in (
                "messages",
                "conversations",
                "tools",
                "system",
                "instruction",
                "input",
                "output",
                "reasoning_effort",
            )
        )
        kwargs = dict(cfg.chat_template_kwargs)
        if row.get("reasoning_effort") is not None:
            kwargs["reasoning_effort"] = row["reasoning_effort"]
        answers = _answers(messages)
        thinking = [i for i, m in enumerate(messages) if m.get("thinking")]
        shown = [] if cfg.reasoning == "drop" else [i for i in thinking if i in answers]  # a tool call's: only when
        if cfg.reasoning == "drop":  # no answer follows
            for i in thinking:
                del messages[i]["thinking"]
        if not answers:  # only tool calls: nothing the final-channel mask could label
            stats.unanswered.append(n)
            continue
        if answers[-1] < max(i for i, m in enumerate(messages) if m["role"] == "assistant"):
            stats.call_endings.append(n)  # kept up to its last answer; the tool call after it is not trained
        split = len(answers) > 1
        stats.split_rows += split
        for k, end in enumerate(answers):
            try:
                ids = list(
                    tokenizer.apply_chat_template(
                        messages[: end + 1], tools=tools, tokenize=True, return_dict=False, **kwargs
                    )
                )
            except Exception as exc:  # jinja2's TemplateError / UndefinedError, or TypeError inside the template
                raise sft.SFTDataError(
                    f"{source} {stats.label(n)}: the chat template cannot render it: {type(exc).__name__}: {exc}"
                ) from None
            labels = final_channel_labels(ids, tokenizer, last_only=True, analysis=cfg.reasoning == "train")
            turns = range(answers[k - 1] + 1 if k else 0, end + 1)  # since the last answer: counted if trained
            calls = sum(len(messages[i].get("tool_calls") or ()) for i in turns if i < end)
            hidden = [0] * sum(i in thinking and i not in shown for i in turns)  # 0: counted unless dropped
            key = "dropped" if cfg.reasoning == "drop" else "unrendered"
            example = stats.add(n, ids, labels, [(0, calls)], [0] if end in shown else [], **{key: hidden})
            if example is not None:
                examples.append(example)
    stats.ignored = dict(ignored)
    stats.check_dropped(cfg.max_dropped_fraction)
    return examples, stats


def load_data(cfg: DataConfig, tokenizer) -> tuple[list[dict], sft.SFTStats]:
    """The training examples of ``data.train_files`` (in order), else of ``data.hub_id``'s train split."""
    sources = [(f, sft.load_rows(f, "data.train_files")) for f in cfg.train_files] or [
        (cfg.hub_id, sft.load_hub_rows(cfg.hub_id))
    ]
    parts = [tokenize_rows(rows, tokenizer, cfg, source) for source, rows in sources]
    return [e for examples, _ in parts for e in examples], sft.SFTStats.merge([st for _, st in parts])


# ----------------------------------------------------------------------------- model
def active_flops(model: torch.nn.Module, hf_config):
    """`cookbook.metrics.ModelFlops` on the parameters a token uses: the experts (``*.mlp.experts``) count
    ``num_experts_per_tok / num_local_experts`` of theirs; all layers' attention counted as full (an upper bound
    for the sliding-window layers)."""
    from cookbook.metrics import ModelFlops, count_parameters

    routed = sum(p.numel() for name, m in model.named_modules() if name.endswith("mlp.experts") for p in m.parameters())
    frac = hf_config.num_experts_per_tok / hf_config.num_local_experts
    return ModelFlops(
        int(count_parameters(model) - routed * (1 - frac)),
        hf_config.num_hidden_layers,
        hf_config.num_attention_heads * hf_config.head_dim,
    )


def load_model(cfg: Config, hf_config, dtype, device_map, log, init_device: torch.device | None = None):
    """The base model: random init from the config, or the checkpoint (MXFP4 dequantized to bf16).

    With ``device_map`` (DDP) the whole model is built on that device. Without it (FSDP, random init): on
    meta on every rank, and on rank 0 materialised on the CPU with values drawn module by module on
    `init_device` (``cookbook.lm.init_sharded_weights``).
    """
    from transformers import AutoModelForCausalLM

    if not cfg.model.pretrained:
        torch.manual_seed(cfg.train.seed)
        if device_map:  # DDP: on this rank's GPU
            with torch.device(device_map[""]):
                return AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
        # FSDP with cpu_ram_efficient_loading: rank 0 holds the weights on its CPU, the other ranks only shapes
        # (meta); the Trainer broadcasts rank 0's to the shards. Rank 0 builds on meta too and draws the values
        # module by module on its GPU (transformers' init rules): drawing 21 B values on the CPU was not done
        # after 3.6 minutes on the H200 machine (CPU random number generation runs on one thread).
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
        if int(os.environ.get("RANK", "0")) == 0:
            model.to_empty(device="cpu")
            lm.init_sharded_weights(model, cfg.train.seed, init_device or torch.device("cpu"))
        return model
    kwargs = {}
    quant = getattr(hf_config, "quantization_config", None) or {}
    if (quant if isinstance(quant, dict) else quant.to_dict()).get("quant_method") == "mxfp4":
        from transformers import Mxfp4Config

        # transformers' MXFP4 quantizer is not trainable (is_trainable is False, the Trainer refuses it)
        kwargs["quantization_config"] = Mxfp4Config(dequantize=True)
        log.info(
            f"{cfg.model.name_or_path}: MXFP4 expert weights dequantized to {str(dtype).removeprefix('torch.')} "
            f"for training (Mxfp4Config(dequantize=True)): transformers' MXFP4 kernels cannot train"
        )
    return AutoModelForCausalLM.from_pretrained(
        cfg.model.name_or_path, config=hf_config, dtype=dtype, device_map=device_map, **kwargs
    )


def _checkpointing_args(args_class, on: bool) -> dict:
    """The Trainer's activation checkpointing arguments (transformers >= 5.24 calls ``gradient_checkpointing``
    ``activation_checkpointing``; the GPU image's 5.17 knows only the old names)."""
    name = (
        "activation_checkpointing"
        if "activation_checkpointing" in args_class.__dataclass_fields__
        else "gradient_checkpointing"
    )
    return {name: on, **({f"{name}_kwargs": {"use_reentrant": False}} if on else {})}


# ----------------------------------------------------------------------------- recipe
def load(path: str, overrides: list[str]) -> Config:
    cfg = load_config(Config, path, overrides)
    check_config(cfg, Path(path).resolve().parent, cookbook.get_dist_info().device.type == "cpu")
    return cfg


def preflight(cfg: Config, world_size: int) -> str:
    """What ``--check`` runs in one process before any worker starts (launch.sh): the tokenizer, every row of the
    local files, then the resume; returns what the data holds and the LoRA and parallel settings."""
    tokenizer = sft.load_tokenizer(cfg.model.tokenizer, cfg.model.name_or_path, cfg.data.max_length)
    note = f"data from {cfg.data.hub_id}"
    if cfg.data.train_files:  # before the resume: a bad row is named on a used output_dir too
        examples, stats = load_data(cfg.data, tokenizer)
        sft.check_one_step(len(examples), cfg.train.micro_batch_size, cfg.train.grad_accum_steps, world_size)
        note = f"{len(examples)} train examples"
    hf_trainer.check_resume(cfg, world_size, MAY_CHANGE, CANNOT_REMAP)
    if cfg.data.train_files:
        print(f"data: {stats.summary()}")
    return f"{note}; parallel {cfg.parallel}, LoRA r={cfg.lora.r} alpha={cfg.lora.alpha}"


def show_examples(cfg: Config, n: int) -> str:
    tokenizer = sft.load_tokenizer(cfg.model.tokenizer, cfg.model.name_or_path)
    sources = [(f, sft.load_rows(f, "data.train_files")) for f in cfg.data.train_files] or [
        (cfg.data.hub_id, sft.load_hub_rows(cfg.data.hub_id))
    ]
    shown = replace(cfg.data, max_dropped_fraction=1.0)  # show what would be refused too
    parts = [tokenize_rows(rows, tokenizer, shown, source) for source, rows in sources]
    return sft.show_examples(parts, tokenizer, n)


@cookbook.cli(load, preflight, show_examples)  # --check: preflight; --show-examples N: show_examples
def main(cfg: Config) -> None:
    train(cfg, on_cpu=cookbook.get_dist_info().device.type == "cpu")  # COOKBOOK_DEVICE=cpu, or no GPU


class Trainer(hf_trainer.Bookkeeping, SFTTrainer):
    """TRL's SFTTrainer with the cookbook's bookkeeping (`hf_trainer.Bookkeeping`)."""


def train(cfg: Config, on_cpu: bool) -> None:
    """Set up the model with LoRA, the data and the SFTTrainer (DDP or FSDP2); train; export. Run on every rank."""
    import datasets
    from peft import LoraConfig as PeftLoraConfig, get_peft_model
    from transformers import AutoConfig, AutoTokenizer
    from transformers import logging as hf_logging
    from trl import SFTConfig

    from cookbook.loop import log_outputs
    from cookbook.metrics import MetricsLogger

    hf_logging.disable_progress_bar()
    info = cookbook.init_distributed(cfg.train.collective_timeout_s, debug_dir=Path(cfg.output_dir) / "debug")
    log = cookbook.get_logger()
    out_dir = Path(cfg.output_dir)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer)
    pad_id = sft.pad_token_id(tokenizer)
    examples, stats = load_data(cfg.data, tokenizer)
    t = cfg.train
    per_step = t.micro_batch_size * t.grad_accum_steps * info.world_size
    sft.check_one_step(len(examples), t.micro_batch_size, t.grad_accum_steps, info.world_size)
    max_steps = t.max_steps if t.max_steps > 0 else t.epochs * (len(examples) // per_step)
    resume_from = hf_trainer.check_resume(cfg, info.world_size, MAY_CHANGE, CANNOT_REMAP)
    if hf_trainer.finished(out_dir, resume_from, max_steps):
        return

    fsdp = cfg.parallel == "fsdp"
    bf16 = t.mixed_precision == "bf16" and not on_cpu
    ac = t.activation_checkpointing == "full"
    # The SFTConfig (TrainingArguments) comes first: with fsdp it sets the environment from_pretrained reads.
    args = SFTConfig(
        **hf_trainer.trainer_args(cfg, max_steps),
        use_cpu=on_cpu,
        bf16=bf16,
        optim=cfg.optim.optimizer,
        learning_rate=cfg.optim.lr,
        weight_decay=cfg.optim.weight_decay,
        adam_beta1=cfg.optim.betas[0],
        adam_beta2=cfg.optim.betas[1],
        adam_epsilon=cfg.optim.eps,
        lr_scheduler_type=cfg.optim.scheduler,
        warmup_steps=int(cfg.optim.warmup_ratio * max_steps),
        max_grad_norm=cfg.optim.max_grad_norm,
        # the technique: DDP (the Trainer's default under torchrun) or FSDP2 with its own activation checkpointing
        fsdp="full_shard auto_wrap" if fsdp else "",
        fsdp_config={
            "version": 2,
            "transformer_layer_cls_to_wrap": ["GptOssDecoderLayer"],
            "activation_checkpointing": ac,  # whole layers; "experts" is the recipe's own (below)
            "cpu_ram_efficient_loading": True,
        }
        if fsdp
        else None,  # only rank 0 reads the weights
        **_checkpointing_args(SFTConfig, ac and not fsdp),
        ddp_find_unused_parameters=False,
        dataloader_num_workers=cfg.data.num_workers,
        remove_unused_columns=False,
        max_length=cfg.data.max_length,
        packing=False,
        dataset_kwargs={"skip_prepare_dataset": True},
        average_tokens_across_devices=True,
    )
    dtype = torch.bfloat16 if bf16 else torch.float32
    hf_config = AutoConfig.from_pretrained(cfg.model.name_or_path, attn_implementation=cfg.model.attn_implementation)
    device_map = None if fsdp else {"": str(info.device)}  # DDP: this rank's whole copy on cuda:LOCAL_RANK
    started = time.perf_counter()
    model = load_model(cfg, hf_config, dtype, device_map, log, init_device=info.device)
    log.info(
        f"base model {'loaded' if cfg.model.pretrained else 'made (random init)'} in "
        f"{time.perf_counter() - started:.1f} s ({'on the CPU, for FSDP to shard' if fsdp else info.device})"
    )
    flops = active_flops(model, hf_config)
    model = get_peft_model(model, PeftLoraConfig(**cfg.lora.peft_kwargs(), bias="none", task_type="CAUSAL_LM"))
    if t.activation_checkpointing == "experts":  # recompute the MoE blocks only; attention keeps its activations
        lm.checkpoint_modules(m.mlp for m in model.modules() if type(m).__name__ == "GptOssDecoderLayer")
    if t.compile:  # after the checkpoint wrappers: each layer one compiled region, one code for all layers
        for layer in model.base_model.model.model.layers:
            layer.compile(backend=COMPILE_BACKEND)
    metrics = MetricsLogger.for_run(cfg, info, experiment="gpt-oss-lora", flops=flops, max_steps=max_steps)

    # What TrainLoop does when things fail (cookbook.hf_trainer): preemption, non-finite steps, stalls, failed saves.
    run = hf_trainer.TrainerRun(cfg, metrics, pad_id, resume_from)
    trainer = Trainer(
        model=model,
        args=args,
        processing_class=tokenizer,
        train_dataset=datasets.Dataset.from_list(examples),
        data_collator=partial(sft.collate, pad_id=pad_id, cu_seq_lens=False),
        callbacks=run.callbacks,
    )
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log.info(
        f"world size {info.world_size} ({info.backend}) | {cfg.parallel.upper()} | {flops.num_params / 1e6:,.1f} M "
        f"active non-embedding params, {n_trainable / 1e6:,.2f} M trainable (LoRA r={cfg.lora.r}) | "
        f"{cfg.model.attn_implementation} | global batch {per_step} rows | {max_steps} steps | "
        f"{'bf16' if bf16 else 'fp32'} | data: {stats.summary()}"
    )

    with run:  # closes metrics and the group whatever happens
        if not run.train(trainer, max_steps):
            return  # train.stop_at_step: a checkpoint is published there
        step = trainer.state.global_step
        export_dir = hf_trainer.export_final(trainer, tokenizer, out_dir) if cfg.checkpoint.export_hf else None
        metrics.log_summary({"step": step, "export_dir": str(export_dir) if export_dir else None})
        log_outputs(step, {}, metrics, run.root, {"export_dir": (export_dir, "AutoModelForCausalLM.from_pretrained")})


if __name__ == "__main__":
    cookbook.run_main(main, user_errors=(ConfigError, sft.SFTDataError, CheckpointError))
