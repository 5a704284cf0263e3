"""Receipt OCR -> JSON: supervised fine-tuning of Qwen3-8B with TRL's SFTTrainer and DeepSpeed ZeRO (3, 2 or 1).

Commands (from this folder; NGPU defaults to all visible GPUs, else 2 CPU processes; NGPU=1 runs one process):

    ./launch.sh                                            # Qwen3-8B, ZeRO-3, SROIE receipts, all GPUs of this node
    ./launch.sh lora.enabled=true                          # LoRA adapters under ZeRO-3
    ./launch.sh deepspeed.config=zero2.json                # ZeRO-2 (or zero1.json)
    ./launch.sh data.eval_files=[sroie2019_test.jsonl]     # score the SROIE test split instead of a held-out part
    CONFIG_FILE=llama3.2-1b.yaml ./launch.sh               # Llama-3.2-1B-Instruct, the small DeepSpeed example
    CONFIG_FILE=tiny.yaml ./launch.sh                      # tiny Qwen3, offline, CPU-friendly
    NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 ./launch.sh  # on each node (NODE_RANK=1 on the second)

What it supports (DeepSpeed JSONs, data, evaluation, checkpoints, failures): README.md beside this file.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import json
import os
import time
import warnings
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", message=".*set_vital.*")
warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.* is deprecated")  # DeepSpeed's collectives
warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor.* is deprecated")

import cookbook  # first: a package built for another torch is one line (cookbook.builds)
import torch
from transformers import AutoConfig, AutoTokenizer
from transformers import logging as hf_logging
from trl import SFTTrainer  # does not import DeepSpeed: init_deepspeed still comes first

from cookbook import hf_trainer, sft
from cookbook.checkpoint import CheckpointError
from cookbook.loop import NonFinitePolicy
from cookbook import config
from cookbook.config import ConfigError, check_fields, load_config
from cookbook.hub import check_local_model, resolve_path

import deepspeed_config  # beside this file: the DeepSpeed JSON, checked before any worker

hf_logging.disable_progress_bar()
FIELDS = ("company", "date", "address", "total")
INSTRUCTION = (
    "Extract the company, date, address and total of the receipt above. Answer with one JSON object "
    "with exactly these keys; use null for a field that is not on the receipt."
)


# ----------------------------------------------------------------------------- config
@dataclass
class ModelConfig:
    name_or_path: str = "Qwen/Qwen3-8B"  # hub id or local folder (config.json, *.safetensors)
    pretrained: bool = True  # False: random init from config.json (benchmarks, CI)
    tokenizer: str | None = None  # default: name_or_path
    attn_implementation: str = "sdpa"  # sdpa, eager, flash_attention_2


@dataclass
class LoraConfig(config.LoraConfig):  # r, alpha, dropout, target_modules; here every linear layer of the decoder
    dropout: float = 0.05
    target_modules: list[str] = field(default_factory=lambda: list(config.DECODER_LINEARS))
    enabled: bool = False  # false: full fine-tuning


@dataclass
class DeepSpeedSection:
    config: str = "zero3.json"  # DeepSpeed JSON; relative paths are looked up beside the YAML config


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)  # SROIE JSONL / JSON; empty: hub_id
    eval_files: list[str] = field(
        default_factory=list
    )  # same formats (e.g. the SROIE test split); empty: eval_fraction
    hub_id: str = ""  # a Hugging Face data set whose rows have the same fields (id, entities, ocr_boxes)
    eval_fraction: float = 0.05  # validation split carved from train (seeded); unused when eval_files are given
    max_length: int = 1024  # tokens per example; a longer receipt is refused (its JSON would be cut)
    packing: bool = False  # True: pack examples into rows of exactly max_length tokens
    fields: list[str] = field(default_factory=lambda: list(FIELDS))
    num_workers: int = 1
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # {enable_thinking: false} for Qwen3
    max_dropped_fraction: float = (
        0.1  # refuse when more receipts are longer than max_length (they are dropped, not cut)
    )


@dataclass
class OptimConfig(config.OptimConfig):
    optimizer: str = "adamw_torch_fused"  # a transformers `optim` name; "adamw_torch" on CPU


@dataclass
class TrainConfig:
    seed: int = 42
    micro_batch_size: int = 2  # rows per GPU per micro-step
    grad_accum_steps: int = 1
    epochs: int = 1
    max_steps: int = -1
    stop_at_step: int = -1  # stop (with a checkpoint) after this step; run again to continue
    mixed_precision: str = "bf16"  # bf16 compute with fp32 master weights (GPU only; CPU runs in fp32), or fp32
    activation_checkpointing: str = "full"  # none, full (recompute each decoder layer in backward)
    log_every: int = 10
    eval_every: int = 0  # validation loss + generation every N steps; 0: at the end only
    on_nonfinite: str = "stop"  # a step whose gradient norm is NaN/inf (DeepSpeed discards it): stop (exit 4) or skip
    max_consecutive_skips: int = 5  # on_nonfinite=skip: the run stops at one more non-finite step in a row
    collective_timeout_s: float = 1800.0  # a collective waiting longer ends the run, naming the rank that is behind


@dataclass
class EvalConfig:
    max_new_tokens: int = 192
    batch_size: int = 8  # prompts per GPU per generate call
    max_samples: int = 0  # 0: the whole validation split


@dataclass
class Config(config.RunConfig):
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    deepspeed: DeepSpeedSection = field(default_factory=DeepSpeedSection)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: config.HFCheckpointConfig = field(default_factory=config.HFCheckpointConfig)


# Settings that may differ between a checkpoint and the run that resumes it; any other change is refused.
MAY_CHANGE = (*config.MAY_CHANGE, *sft.MAY_CHANGE, "eval.*")


def check_config(cfg: Config, config_dir: Path) -> None:
    """Resolve paths against the config file's folder and reject incompatible values (before any worker)."""
    cfg.model.name_or_path = resolve_path(cfg.model.name_or_path, config_dir)
    cfg.model.tokenizer = resolve_path(cfg.model.tokenizer or cfg.model.name_or_path, config_dir)
    check_local_model(cfg.model.name_or_path, "model.name_or_path")  # a path, not a hub id: said so, not tried
    check_local_model(cfg.model.tokenizer, "model.tokenizer", tokenizer=True)
    cfg.data.train_files = [resolve_path(f, config_dir) for f in cfg.data.train_files]
    cfg.data.eval_files = [resolve_path(f, config_dir) for f in cfg.data.eval_files]
    cfg.deepspeed.config = resolve_path(cfg.deepspeed.config, config_dir)
    config.check_run(cfg)
    check_fields(
        cfg,
        at_least={"data.max_length": 1, "eval.max_new_tokens": 1, "eval.batch_size": 1, "lora.r": 1},
        one_of={"train.activation_checkpointing": ("none", "full")},
        within={"data.eval_fraction": "[0, 1)", "data.max_dropped_fraction": "[0, 1]"},
        notes={"data.eval_fraction": "0: no evaluation unless data.eval_files are given"},
    )
    if not cfg.data.fields or len(set(cfg.data.fields)) != len(cfg.data.fields):
        raise ConfigError(f"data.fields must be a non-empty list of distinct names, got {cfg.data.fields}")
    if not cfg.data.train_files and not cfg.data.hub_id:
        raise ConfigError("set data.train_files (SROIE JSONL files) or data.hub_id")
    NonFinitePolicy.from_config(cfg.train)  # train.on_nonfinite, train.max_consecutive_skips


def check_deepspeed_config(cfg: Config, world_size: int) -> dict:
    """The DeepSpeed JSON (``deepspeed.config``) as a dict, checked against this config for `world_size` ranks.

    Raises:
        ConfigError: see `deepspeed_config.check_deepspeed_config`.
    """
    return deepspeed_config.check_deepspeed_config(
        cfg.deepspeed.config,
        micro_batch_size=cfg.train.micro_batch_size,
        grad_accum_steps=cfg.train.grad_accum_steps,
        world_size=world_size,
        max_grad_norm=cfg.optim.max_grad_norm,
        export_16bit=cfg.checkpoint.export_hf,
    )


# ----------------------------------------------------------------------------- data
def ocr_text(boxes: list, where: str) -> str:
    """The OCR boxes of one receipt as text lines in reading order.

    Args:
        boxes: SROIE ``ocr_boxes``: ``[x1, y1, x2, y2, x3, y3, x4, y4, text]`` per box (pixels, corners clockwise
            from top-left).
        where: ``"<file> row <n>"``, for messages.

    Boxes are sorted by their vertical centre; a box whose centre lies within half a median box height of the
    current line's joins it; each line is ordered left to right and joined with spaces.

    Raises:
        sft.SFTDataError: the list is empty, or a box is not 8 numbers and a string.
    """
    if not isinstance(boxes, list) or not boxes:
        raise sft.SFTDataError(f"{where}: field 'ocr_boxes' is empty or not a list: no OCR text to read")
    items = []
    for i, box in enumerate(boxes):
        if (
            not isinstance(box, list)
            or len(box) != 9
            or not isinstance(box[8], str)
            or not all(isinstance(v, (int, float)) for v in box[:8])
        ):
            raise sft.SFTDataError(
                f"{where}: ocr_boxes[{i}] must be [x1, y1, ..., x4, y4, text] (8 numbers and a "
                f"string), got {str(box)[:80]}"
            )
        ys, xs = box[1:8:2], box[0:8:2]
        items.append(((min(ys) + max(ys)) / 2, max(ys) - min(ys), min(xs), box[8].strip()))
    half = max(1.0, sorted(h for _, h, _, _ in items)[len(items) // 2] / 2)
    lines: list[list[tuple]] = []
    for item in sorted(items):
        if lines and abs(item[0] - lines[-1][0][0]) <= half:
            lines[-1].append(item)
        else:
            lines.append([item])
    return "\n".join(" ".join(t for _, _, _, t in sorted(line, key=lambda it: it[2]) if t) for line in lines)


def receipt_messages(row: dict, where: str, fields: list[str]) -> list[dict]:
    """One SROIE row as a user turn (OCR lines, then the instruction) and an assistant turn (the JSON).

    The JSON has the keys of `fields` in that order; a field missing from ``entities`` is ``null``.

    Raises:
        sft.SFTDataError: no ``entities`` (or none of `fields`), a non-string entity, or bad ``ocr_boxes``.
    """
    entities = row.get("entities")
    if not isinstance(entities, dict) or not any(
        isinstance(entities.get(f), str) and entities[f].strip() for f in fields
    ):
        raise sft.SFTDataError(
            f"{where}: field 'entities' has none of {', '.join(fields)}: nothing to learn from "
            f"this receipt (got {str(entities)[:80]})"
        )
    target = {}
    for f in fields:
        value = entities.get(f)
        if value is not None and not isinstance(value, str):
            raise sft.SFTDataError(f"{where}: entities.{f} must be a string, got {type(value).__name__}")
        target[f] = value.strip() if value and value.strip() else None
    prompt = f"{ocr_text(row.get('ocr_boxes'), where)}\n\n{instruction(fields)}"
    return [
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": json.dumps(target, ensure_ascii=False)},
    ]


def instruction(fields: list[str]) -> str:
    """The instruction after the OCR text (the default wording for SROIE's four fields)."""
    if list(fields) == list(FIELDS):
        return INSTRUCTION
    return (
        f"Extract {', '.join(fields)} of the receipt above. Answer with one JSON object with exactly these keys; "
        f"use null for a field that is not on the receipt."
    )


@dataclass
class Receipts:
    """Tokenized receipts: ``train`` / ``val`` examples (``input_ids``, ``labels``) in row order, the positions
    of those rows in their input (``train_index`` over all train files in order; ``val_index`` over the train
    files when the validation split is carved from them, over ``data.eval_files`` when those are given; both
    0-based), and for the validation rows the generation prompts (token ids ending in the assistant header) and
    expected fields. ``stats`` counts the train files' rows (a carved validation split included)."""

    train: list[dict]
    val: list[dict]
    train_index: list[int]
    val_index: list[int]
    val_prompts: list[list[int]]
    val_targets: list[dict]
    stats: sft.SFTStats
    eval_stats: sft.SFTStats | None = None  # data.eval_files' counts, when given


def _tokenize_receipts(sources: list[tuple[str, list[dict]]], cfg: DataConfig, tokenizer, kwargs: dict | None):
    """Messages and tokenized examples of the rows of `sources` (``(name, rows)`` pairs) that fit in
    ``cfg.max_length``, in order, with their 0-based positions over all sources and the statistics. A receipt
    longer than ``max_length`` is dropped, not cut (a cut JSON teaches the model to stop mid-object), and
    counted. Raises `sft.SFTDataError` for a bad row or more than ``cfg.max_dropped_fraction`` of a
    file's rows dropped."""
    messages, examples, kept, parts = [], [], [], []
    for source, file_rows in sources:
        lines = getattr(file_rows, "lines", None)
        file_messages = [
            receipt_messages(
                row, f"{source} {sft.row_label(n, lines)}" + (f" (id {row['id']})" if "id" in row else ""), cfg.fields
            )
            for n, row in enumerate(file_rows, 1)
        ]
        file_examples, st = sft.prepare(
            sft.RowList(({"messages": m} for m in file_messages), lines),
            tokenizer,
            cfg.max_length,
            source,
            kwargs,
            max_dropped_fraction=cfg.max_dropped_fraction,
            truncate=False,
        )
        assert not st.empty_answers  # every receipt has a non-empty JSON answer
        kept += [len(messages) + n - 1 for n in st.example_rows]  # 0-based over all files
        messages += file_messages
        examples += file_examples
        parts.append(st)
    return [messages[i] for i in kept], examples, kept, sft.SFTStats.merge(parts)


def show_receipts(cfg: DataConfig, tokenizer, n: int) -> str:
    """`cookbook.sft.show_examples` of each train file's receipts, tokenized as `load_receipts` does (before the
    validation split); a source that training would refuse is shown with the refusal instead of stopping."""
    from cookbook.sft.data import held_out_note, refusal

    kwargs, parts = dict(cfg.chat_template_kwargs) or None, []
    for source in cfg.train_files or [cfg.hub_id]:
        rows = sft.load_rows(source, "data.train_files") if cfg.train_files else sft.load_hub_rows(source)
        lines = getattr(rows, "lines", None)
        messages = [
            receipt_messages(row, f"{source} {sft.row_label(k, lines)}", cfg.fields) for k, row in enumerate(rows, 1)
        ]
        parts.append(
            sft.prepare(
                sft.RowList(({"messages": m} for m in messages), lines),
                tokenizer,
                cfg.max_length,
                source,
                kwargs,
                truncate=False,
            )
        )
    notes = [refusal(st, cfg.max_dropped_fraction) for _, st in parts] + [held_out_note(cfg)]
    return sft.show_examples(parts, tokenizer, n) + "".join(f"\n{x}" for x in notes if x)


def load_receipts(cfg: DataConfig, tokenizer, seed: int) -> Receipts:
    """Read, validate, tokenize and split the receipts.

    The validation rows are those of ``data.eval_files`` when given (all of them, in order; every train row
    trains), else a seeded ``data.eval_fraction`` of the train rows (at least one when the fraction is > 0).
    A row longer than ``max_length`` tokens would lose the end of its JSON, so it is dropped rather than
    cut, and counted in ``stats`` (row and token count).

    Raises:
        sft.SFTDataError: a bad file or row (see `receipt_messages`), more than ``max_dropped_fraction``
            of a file's rows longer than ``max_length``, or a tokenizer without a chat template.
    """
    kwargs = dict(cfg.chat_template_kwargs) or None
    sources = [(f, sft.load_rows(f, "data.train_files")) for f in cfg.train_files] or [
        (cfg.hub_id, sft.load_hub_rows(cfg.hub_id))
    ]
    messages, examples, kept, stats = _tokenize_receipts(sources, cfg, tokenizer, kwargs)
    if cfg.eval_files:
        val_messages, val_examples, val_kept, eval_stats = _tokenize_receipts(
            [(f, sft.load_rows(f)) for f in cfg.eval_files], cfg, tokenizer, kwargs
        )
        train_idx, val_idx = list(range(len(examples))), list(range(len(val_examples)))
    else:
        n_val = max(1, int(len(examples) * cfg.eval_fraction)) if cfg.eval_fraction > 0 else 0
        order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
        val_idx, train_idx = sorted(order[:n_val]), sorted(order[n_val:])
        val_messages, val_examples, val_kept, eval_stats = messages, examples, kept, None
    # generation prompts: the user turn and the assistant header (add_generation_prompt)
    val_prompts = [
        list(
            tokenizer.apply_chat_template(
                val_messages[i][:1], tokenize=True, add_generation_prompt=True, return_dict=False, **(kwargs or {})
            )
        )
        for i in val_idx
    ]
    val_targets = [json.loads(val_messages[i][1]["content"]) for i in val_idx]
    return Receipts(
        [examples[i] for i in train_idx],
        [val_examples[i] for i in val_idx],
        [kept[i] for i in train_idx],
        [val_kept[i] for i in val_idx],
        val_prompts,
        val_targets,
        stats,
        eval_stats,
    )


# ----------------------------------------------------------------------------- generation eval
def parse_fields(text: str) -> dict | None:
    """The JSON object in a generated answer, or ``None`` if the text is not one JSON object."""
    try:
        value = json.loads(text.strip())
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def _norm(value: Any) -> str | None:
    return None if value is None else " ".join(str(value).split())


def score(predictions: list[dict | None], targets: list[dict], fields: list[str]) -> dict[str, float]:
    """Counts for the generation metrics of one set of answers.

    Args:
        predictions: the parsed answers (`parse_fields`; ``None`` for an answer that is not one JSON object),
            one per target, in the same order.
        targets: the expected fields of each receipt (``{field: str or None}``).
        fields: the field names to score.

    Returns:
        ``samples`` (number of targets), ``json_valid`` and ``unparsable`` (answers that are / are not one JSON
        object), ``em_<field>`` per field and ``em_all`` (answers with every field right): counts, as floats
        (so that ranks can sum them). A field matches when both values are equal after collapsing whitespace
        (``null`` matches ``null``, a missing key counts as ``null``); an unparsable answer matches nothing.
    """
    if len(predictions) != len(targets):
        raise ValueError(f"{len(predictions)} predictions for {len(targets)} targets")
    out = {
        "samples": float(len(targets)),
        "json_valid": 0.0,
        "unparsable": 0.0,
        **{f"em_{f}": 0.0 for f in fields},
        "em_all": 0.0,
    }
    for pred, target in zip(predictions, targets):
        if pred is None:
            out["unparsable"] += 1
            continue
        out["json_valid"] += 1
        hits = [_norm(pred.get(f)) == _norm(target.get(f)) for f in fields]
        for f, hit in zip(fields, hits):
            out[f"em_{f}"] += hit
        out["em_all"] += all(hits)
    return out


@torch.no_grad()
def generation_eval(
    model, tokenizer, prompts: list[list[int]], targets: list[dict], fields: list[str], ecfg: EvalConfig, info
) -> dict[str, float]:
    """Greedy generation on this rank's share of the validation prompts; rates over all ranks.

    Collective: every rank runs the same number of ``generate`` calls (ZeRO-3 gathers parameters in every
    forward, so ``synced_gpus`` keeps ranks that finished early stepping), padding its share with copies that
    are not scored.

    Returns:
        ``json_valid`` (fraction of answers that are one JSON object), ``em_<field>`` and ``em_all``
        (fraction exactly right; an unparsable answer is a miss), ``samples`` (number of receipts scored, each
        once) and ``unparsable`` (number of answers that are not one JSON object).
    """
    import cookbook

    if ecfg.max_samples > 0:
        prompts, targets = prompts[: ecfg.max_samples], targets[: ecfg.max_samples]
    mine = list(range(info.rank, len(prompts), info.world_size))
    per_rank = -(-len(prompts) // info.world_size)
    padded = mine + [0] * (per_rank - len(mine))
    pad_id = sft.pad_token_id(tokenizer)
    was_training = model.training
    model.eval()
    predictions = []
    for start in range(0, len(padded), ecfg.batch_size):
        batch = [prompts[i] for i in padded[start : start + ecfg.batch_size]]
        width = max(len(p) for p in batch)  # left padding, so every answer starts at column `width`
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch], device=info.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=info.device)
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=ecfg.max_new_tokens,
            do_sample=False,
            synced_gpus=info.world_size > 1,
            pad_token_id=pad_id,
            eos_token_id=tokenizer.eos_token_id,
            use_cache=True,
        )
        predictions += [parse_fields(tokenizer.decode(o[width:], skip_special_tokens=True)) for o in out]
    if was_training:
        model.train()
    counts = score(predictions[: len(mine)], [targets[i] for i in mine], fields)
    totals = cookbook.all_reduce_sum(counts, info.device)
    n, unparsable = totals.pop("samples"), totals.pop("unparsable")
    return {**{k: v / max(n, 1.0) for k, v in totals.items()}, "samples": n, "unparsable": unparsable}


def eval_line(values: dict[str, float], fields: list[str]) -> str:
    """One line for the log: the validation loss per label token and the exact-match rates (`generation_eval`)."""
    parts = []
    if "loss" in values:
        parts.append(f"eval loss {values['loss']:.4f} per token ({values['tokens']:.0f} tokens)")
    if "samples" in values:
        rates = ", ".join(f"{f} {values[f'em_{f}']:.3f}" for f in fields)
        parts.append(
            f"exact match on {values['samples']:.0f} receipts: {rates}, all {values['em_all']:.3f} | "
            f"unparsable {values['unparsable']:.0f}"
        )
    return " | ".join(parts)


# ----------------------------------------------------------------------------- checkpoints
CANNOT_REMAP = (
    "DeepSpeed's ZeRO partitions of the optimizer state cannot be remapped"  # why a resume keeps the world size
)


def check_resume(cfg: Config, world_size: int) -> Path | None:
    """The checkpoint to resume from (``checkpoint.resume``: auto, none or a folder), checked against this run.
    Raises `CheckpointError` (`cookbook.hf_trainer.check_resume`)."""
    return hf_trainer.check_resume(cfg, world_size, MAY_CHANGE, CANNOT_REMAP)


# ----------------------------------------------------------------------------- recipe
def load(path: str, overrides: list[str]) -> Config:
    cfg = load_config(Config, path, overrides)
    check_config(cfg, Path(path).resolve().parent)
    return cfg


def preflight(cfg: Config, world_size: int) -> str:
    """What ``--check`` runs in one process before any worker starts (launch.sh): the DeepSpeed config, the
    tokenizer and model config, every receipt, then the resume; returns what the data holds."""
    check_deepspeed_config(cfg, world_size)
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer)
        hf_config = AutoConfig.from_pretrained(cfg.model.name_or_path)
    except OSError as exc:
        raise ConfigError(
            f"model.name_or_path / model.tokenizer: cannot load {cfg.model.name_or_path!r}: {str(exc).splitlines()[0]}"
        ) from None
    sft.check_vocab(tokenizer, hf_config.vocab_size)
    sft.check_positions(cfg.data.max_length, hf_config, cfg.model.name_or_path)
    data = load_receipts(
        cfg.data, tokenizer, cfg.train.seed
    )  # before the resume: a bad row is named on a used output_dir
    pad_id = sft.pad_token_id(tokenizer)
    n_rows = len(sft.pack(data.train, cfg.data.max_length, pad_id)) if cfg.data.packing else len(data.train)
    per_step = cfg.train.micro_batch_size * cfg.train.grad_accum_steps * world_size
    if n_rows < per_step:
        raise ConfigError(
            f"{n_rows} training rows (after holding out {len(data.val)} receipts for validation) are "
            f"too few for one step of {cfg.train.micro_batch_size} x {cfg.train.grad_accum_steps} x "
            f"{world_size} rows"
        )
    check_resume(cfg, world_size)
    print(
        f"data: {data.stats.summary()}"
        + (f"\ndata (eval files): {data.eval_stats.summary()}" if data.eval_stats else "")
    )
    return f"{len(data.train)} train / {len(data.val)} validation receipts"


def show_examples(cfg: Config, n: int) -> str:
    """Each receipt as load_receipts renders it: what training sees."""
    return show_receipts(cfg.data, AutoTokenizer.from_pretrained(cfg.model.tokenizer), n)


@cookbook.cli(load, preflight, show_examples)  # --check: preflight; --show-examples N: show_examples
def main(cfg: Config) -> None:
    train(cfg, on_cpu=cookbook.get_dist_info().device.type == "cpu")  # COOKBOOK_DEVICE=cpu, or no GPU


class ReceiptTrainer(hf_trainer.Bookkeeping, SFTTrainer):
    """SFTTrainer with the cookbook's bookkeeping (`hf_trainer.Bookkeeping`) that evaluates the loss per label token
    over exactly the validation rows (`evaluate`): `val_rows` (tokenized rows, the whole split on every rank), sharded
    by `info` (this process's `cookbook.DistInfo`)."""

    def __init__(self, *args, val_rows: list[dict], info, generation, **kwargs):
        super().__init__(*args, **kwargs)
        self.val_rows, self.info, self.generation = val_rows, info, generation

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
        """Loss and next-token accuracy per label token over the validation rows, each counted once.

        Replaces the Trainer's loop, which pads the last rank's share with duplicate rows and averages
        per-batch means weighted by rows. Here each rank takes every world_size-th row
        (`sft.shard_for_eval`: label-free fillers keep the number of forward passes equal, as ZeRO-3
        gathers parameters collectively), and `sft.evaluate` sums token losses and counts, then one
        all-reduce gives ``sum of losses / number of label tokens``. Logs ``<prefix>_loss``,
        ``_mean_token_accuracy``, ``_tokens`` and the generation scores (`generation`) and calls the callbacks'
        ``on_evaluate``, as the Trainer's own ``evaluate`` does.
        """
        if eval_dataset is not None:
            raise ValueError("ReceiptTrainer.evaluate scores the validation split given at construction")
        model = self.model_wrapped
        was_training = model.training
        model.eval()  # until self.log below (sft.evaluate leaves the mode it finds)
        start = time.perf_counter()
        rows = sft.shard_for_eval(self.val_rows, self.info.rank, self.info.world_size)
        size = self.args.per_device_eval_batch_size
        batches = (self._prepare_inputs(self.data_collator(rows[i : i + size])) for i in range(0, len(rows), size))
        result = sft.evaluate(
            model, batches, self.info.device, context=self.compute_loss_context_manager, accuracy=True
        )
        out = {f"{metric_key_prefix}_{k}": v for k, v in result.items()}  # loss, tokens, mean_token_accuracy
        out[f"{metric_key_prefix}_runtime"] = round(time.perf_counter() - start, 4)
        self.log(out)  # while the model is in eval mode: TRL adds no training metrics to these logs
        if was_training:
            model.train()
        out.update({f"{metric_key_prefix}_{k}": v for k, v in self.generation(self.model).items()})
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, out)
        return out


def train(cfg: Config, on_cpu: bool) -> None:
    """Set up model, data and SFTTrainer under DeepSpeed; train; evaluate; export. Run on every rank."""
    import datasets
    from transformers import AutoModelForCausalLM

    from cookbook.loop import log_outputs
    from cookbook.metrics import MetricsLogger, ModelFlops, count_parameters

    # the process group, then DeepSpeed's communication over it (on CPU gloo, without DeepSpeed's ~40 s JIT build)
    if on_cpu:
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    import deepspeed
    from trl import SFTConfig

    info = cookbook.init_distributed(cfg.train.collective_timeout_s, debug_dir=Path(cfg.output_dir) / "debug")
    deepspeed.init_distributed(
        dist_backend=info.backend, timeout=datetime.timedelta(seconds=cfg.train.collective_timeout_s)
    )

    log = cookbook.get_logger()
    out_dir = Path(cfg.output_dir)
    ds_config = check_deepspeed_config(cfg, info.world_size)
    stage = ds_config["zero_optimization"]["stage"]
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer)
    pad_id = sft.pad_token_id(tokenizer)
    data = load_receipts(cfg.data, tokenizer, cfg.train.seed)
    if cfg.data.packing:
        train_rows, val_rows = (
            sft.pack(data.train, cfg.data.max_length, pad_id),
            sft.pack(data.val, cfg.data.max_length, pad_id),
        )
    else:
        train_rows, val_rows = data.train, data.val
    per_step = cfg.train.micro_batch_size * cfg.train.grad_accum_steps * info.world_size
    steps_per_epoch = len(train_rows) // per_step
    if steps_per_epoch == 0:
        raise ConfigError(f"{len(train_rows)} training rows are too few for one step of {per_step} rows")
    max_steps = cfg.train.max_steps if cfg.train.max_steps > 0 else cfg.train.epochs * steps_per_epoch
    resume_from = check_resume(cfg, info.world_size)
    if hf_trainer.finished(out_dir, resume_from, max_steps):
        return

    hf_config = AutoConfig.from_pretrained(cfg.model.name_or_path, attn_implementation=cfg.model.attn_implementation)
    with torch.device("meta"):  # parameter count for MFU, before ZeRO-3 partitions the real model
        flops = ModelFlops(
            count_parameters(AutoModelForCausalLM.from_config(hf_config)),
            hf_config.num_hidden_layers,
            hf_config.num_attention_heads
            * (getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads),
        )
    bf16 = cfg.train.mixed_precision == "bf16" and not on_cpu
    # The SFTConfig (TrainingArguments) comes first: with a ZeRO-3 JSON it makes from_pretrained / from_config
    # partition the weights across ranks while loading (deepspeed.zero.Init) instead of materialising them.
    args = SFTConfig(
        **hf_trainer.trainer_args(cfg, max_steps),
        deepspeed=cfg.deepspeed.config,
        use_cpu=on_cpu,
        bf16=bf16,
        per_device_eval_batch_size=cfg.train.micro_batch_size,
        optim=cfg.optim.optimizer,
        learning_rate=cfg.optim.lr,
        weight_decay=cfg.optim.weight_decay,
        adam_beta1=cfg.optim.betas[0],
        adam_beta2=cfg.optim.betas[1],
        adam_epsilon=cfg.optim.eps,
        lr_scheduler_type=cfg.optim.scheduler,
        warmup_steps=int(cfg.optim.warmup_ratio * max_steps),
        max_grad_norm=cfg.optim.max_grad_norm,
        gradient_checkpointing=cfg.train.activation_checkpointing == "full",
        eval_strategy="steps" if cfg.train.eval_every > 0 and val_rows else "no",
        eval_steps=cfg.train.eval_every or None,
        dataloader_num_workers=cfg.data.num_workers,
        remove_unused_columns=False,
        max_length=cfg.data.max_length,
        packing=False,
        dataset_kwargs={"skip_prepare_dataset": True},
        average_tokens_across_devices=True,
    )
    dtype = torch.bfloat16 if bf16 else torch.float32
    if cfg.model.pretrained:
        model = AutoModelForCausalLM.from_pretrained(cfg.model.name_or_path, config=hf_config, dtype=dtype)
    else:
        torch.manual_seed(cfg.train.seed)
        # ZeRO-3's zero.Init draws each partition on the rank's GPU; ZeRO-2/1 would draw the whole model on the
        # CPU's one-threaded generator unless it is built on the GPU here.
        with torch.device(info.device) if stage < 3 else contextlib.nullcontext():
            model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    peft_config = None
    if cfg.lora.enabled:
        from peft import LoraConfig as PeftLoraConfig

        peft_config = PeftLoraConfig(**cfg.lora.peft_kwargs(), task_type="CAUSAL_LM")

    metrics = MetricsLogger.for_run(cfg, info, experiment="zero3-receipts", flops=flops, max_steps=max_steps)

    def gen_eval(model_for_eval) -> dict[str, float]:
        if not data.val_prompts:
            return {}
        return generation_eval(
            model_for_eval, tokenizer, data.val_prompts, data.val_targets, cfg.data.fields, cfg.eval, info
        )

    # What TrainLoop does when things fail (cookbook.hf_trainer): preemption, non-finite steps, stalls, failed saves.
    run = hf_trainer.TrainerRun(cfg, metrics, pad_id, resume_from)

    trainer = ReceiptTrainer(
        model=model,
        args=args,
        processing_class=tokenizer,
        peft_config=peft_config,
        train_dataset=datasets.Dataset.from_list(train_rows),
        eval_dataset=datasets.Dataset.from_list(val_rows) if val_rows else None,
        data_collator=partial(sft.collate, pad_id=pad_id, cu_seq_lens=False) if cfg.data.packing else None,
        callbacks=run.callbacks,
        val_rows=val_rows,
        info=info,
        generation=gen_eval,
    )
    n_trainable = sum(
        p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters() if p.requires_grad
    )
    log.info(
        f"world size {info.world_size} ({info.backend}) | DeepSpeed ZeRO-{stage} ({Path(cfg.deepspeed.config).name}) | "
        f"{flops.num_params / 1e6:,.1f} M non-embedding params, {n_trainable / 1e6:,.2f} M trainable"
        f"{' (LoRA r=' + str(cfg.lora.r) + ')' if cfg.lora.enabled else ''} | {len(train_rows)} train rows of "
        f"{'packed ' if cfg.data.packing else ''}<= {cfg.data.max_length} tokens, {len(data.val)} validation "
        f"receipts | global batch {per_step} rows | {max_steps} steps | {'bf16' if bf16 else 'fp32'} | data: "
        f"{data.stats.summary()}"
    )

    with run:  # closes metrics and the group whatever happens
        if not run.train(trainer, max_steps):
            return  # train.stop_at_step: a checkpoint is published there
        step = trainer.state.global_step
        evaluated_last_step = (
            run.metrics_callback.last_eval and cfg.train.eval_every > 0 and step % cfg.train.eval_every == 0
        )
        if val_rows and not evaluated_last_step:
            trainer.evaluate()  # validation loss + generation metrics, through MetricsCallback.on_evaluate
        final = run.metrics_callback.last_eval
        export_dir = hf_trainer.export_final(trainer, tokenizer, out_dir) if cfg.checkpoint.export_hf else None
        outputs = {"export_dir": (export_dir, "AutoModelForCausalLM.from_pretrained")}
        metrics.log_summary(
            {
                "step": step,
                **{f"eval/{k}": v for k, v in final.items()},
                "export_dir": str(export_dir) if export_dir else None,
                "mlflow_uri": metrics.mlflow_uri,
                "mlflow_run_id": metrics.mlflow_run_id,
            }
        )
        log_outputs(
            step, final, metrics, run.root, outputs, eval_text=eval_line(final, cfg.data.fields) if final else ""
        )


if __name__ == "__main__":
    cookbook.run_main(main, user_errors=(ConfigError, sft.SFTDataError, CheckpointError))
