"""LoRA fine-tuning of mixture-of-experts LLMs: dense parts sharded with FSDP2, experts split across ranks
(expert parallelism, all-to-all token dispatch).

Commands (from this folder; NGPU defaults to all visible GPUs, else 2 CPU processes):

    ./launch.sh                                            # Nemotron 3 Nano 30B-A3B (hub), EP=2 on 2 GPUs
    CONFIG_FILE=qwen3-30b-a3b.yaml ./launch.sh parallel.ep=8   # Qwen3-30B-A3B, 8 GPUs, experts on 8 ranks
    CONFIG_FILE=tiny.yaml ./launch.sh                      # tiny Nemotron-H, offline, CPU-friendly
    CONFIG_FILE=tiny.yaml ./launch.sh model.name_or_path=tiny/qwen3-moe data.packing=true
    CONFIG_FILE=qwen3-vl-30b-a3b.yaml ./launch.sh              # Qwen3-VL-30B-A3B, image + text pairs, EP=2
    CONFIG_FILE=tiny_vl.yaml ./launch.sh                   # tiny Qwen3-VL-MoE on 8 ant / bee photos, offline

What this recipe supports:
    - Models: Hugging Face MoE causal LMs whose experts are fused 3-D parameters (transformers 5):
      ``nemotron_h`` (hybrid Mamba-2 / attention / MoE, the default) and ``qwen3_moe``; the vision-language
      ``qwen3_vl_moe`` (Qwen3-VL-30B-A3B) with the same parallel set-up, its vision tower frozen.
    - Loading (``model.pretrained``): by default each rank builds the model on the meta device and reads
      from the safetensors files only the dense weights and its own experts' slices (``load_base_lazily``);
      ``model.lazy_load=false`` loads the whole model per rank with transformers.
    - Expert parallelism (``parallel.ep``, 1 = off): a (dp, ep) device mesh; rank j of each EP group keeps
      experts [j*E/ep, (j+1)*E/ep) of every MoE layer, base weights and LoRA factors alike. Routing runs
      on every rank; each (token, expert) pair is sent to the rank that holds the expert with an autograd
      ``all_to_all_single`` (counts exchanged first), computed by the model's own expert code on the
      local experts, sent back, weighted and summed (``ep_dispatch``). Everything else is FSDP2.
    - FSDP2: ``fully_shard`` on each MoE experts module over the dp dimension (gradients divided by the
      world size), on every decoder layer, every (frozen) vision block and on the root over all ranks; bf16 compute with fp32
      gradient reduction on GPU; frozen base weights stored in the compute dtype, LoRA factors in fp32.
    - LoRA (PEFT): ``lora.target_modules`` (attention projections) and ``lora.target_parameters`` (the
      fused expert weights, PEFT's ``target_parameters``); rank, alpha, dropout in the config; base
      weights frozen. The adapter is created on the whole model before the experts are split, so its
      initial values do not depend on the EP degree.
    - Data (cookbook.sft): chat / Alpaca / ShareGPT rows, chat template, loss on assistant tokens
      only, packing (Qwen3-MoE) or right padding (Nemotron-H: Mamba layers would carry state across
      packed documents). Loss normalised by the assistant tokens of the global batch. Vision-language
      models: image + text rows (``{"images": [...], "messages": [...]}``, local files or a hub data set),
      images decoded and cut into patches by the model's image processor in the loader's workers, one
      placeholder token per merged patch, right padding; bad rows (no image, a missing or undecodable image
      file) are refused with the file and row named, by ``--check`` before any worker starts.
    - Load balancing: the Switch-Transformer auxiliary loss (mean over MoE layers) is reported every step
      and added with ``moe.aux_loss_coef`` (> 0); ``moe/load_max_over_mean`` (busiest expert / mean, mean
      over layers) and ``moe/ep_rank_load_max_over_mean`` (busiest EP rank / mean) are logged.
    - Checkpoints (cookbook.checkpoint, DCP): LoRA weights and AdamW state only (frozen weights are not
      saved), scheduler, data position, RNG, step; atomic publish; ``resume: auto``. Expert adapters are
      stored per EP rank, so a resume needs the same ``parallel.ep`` (refused otherwise, before start).
    - Export: ``<output_dir>/adapter``, the adapter of the unsharded model in PEFT's format (expert
      factors gathered from every EP rank): ``PeftModel.from_pretrained(base, adapter)``; optionally
      (``checkpoint.export_merged``) ``<output_dir>/merged``, base + adapter folded in, a plain model.
    - Metrics (cookbook.metrics): loss, tokens/s per GPU, MFU over the active parameters (attention,
      Mamba, shared experts, router and top-k of the routed experts; not the vision tower), peak memory,
      the MoE keys above.
"""

from __future__ import annotations

import os
import re
import time
import warnings
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", message=".*set_vital.*")
warnings.filterwarnings("ignore", message=".*falling back to its reference PyTorch implementation.*")

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, SchedulerType, get_scheduler
from transformers import logging as hf_logging

import cookbook
from cookbook import lm, sft
from cookbook.checkpoint import Checkpointer, CheckpointError, ModelOptimizerState, RankLocalState, RNGState, TrainState
from cookbook.config import ConfigError, check_fields, cli_parser, load_config, resolve_path, save_config, to_dict
from cookbook.hub import model_folder
from cookbook.metrics import MetricsLogger, ModelFlops, count_parameters
from cookbook.sft import SFTDataError

hf_logging.disable_progress_bar()
hf_logging.set_verbosity_error()
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


# ----------------------------------------------------------------------------- config
@dataclass
class ModelConfig:
    name_or_path: str = "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"  # hub id or local folder
    pretrained: bool = True  # False: random init from config.json (benchmarks, CI)
    lazy_load: bool = True  # pretrained: each rank reads its experts' slices and the dense weights from the
    #                         safetensors files (False: transformers' from_pretrained of the whole model per rank)
    tokenizer: str | None = None  # default: name_or_path (vision-language models: also the image processor)
    attn_implementation: str = "sdpa"


@dataclass
class ParallelConfig:
    ep: int = 1  # expert-parallel degree: divides the world size and the number of experts; 1 = off
    param_dtype: str = "bf16"  # compute dtype (and storage dtype of the frozen base weights) on GPU; CPU: fp32
    reduce_dtype: str = "fp32"  # gradient reduce-scatter dtype
    reshard_after_forward: bool = True


@dataclass
class LoraSection:
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    target_parameters: list[str] = field(default_factory=lambda: ["mixer.experts.up_proj", "mixer.experts.down_proj"])


@dataclass
class MoESection:
    aux_loss_coef: float = 0.0  # > 0 adds coef x load-balancing loss to the objective (always reported)


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)  # JSON / JSONL; empty: hub_id
    eval_files: list[str] = field(default_factory=list)
    hub_id: str = "tatsu-lab/alpaca"
    eval_fraction: float = 0.02
    max_length: int = 2048
    packing: bool = False  # Nemotron-H: keep false (Mamba state would flow across packed documents)
    num_workers: int = 1
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    max_dropped_fraction: float = 0.1  # refuse when more of a file's rows are dropped (cut before the answer, empty answer)
    split_turns: bool = False  # one example per assistant turn (templates that rewrite earlier turns: Qwen3)
    image_min_pixels: int | None = None  # vision-language models: resize bounds (pixels per image; None: the
    image_max_pixels: int | None = None  # image processor's own), i.e. the number of image tokens


@dataclass
class OptimConfig:
    lr: float = 1e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    scheduler: str = "cosine"
    warmup_ratio: float = 0.03
    max_grad_norm: float = 1.0


@dataclass
class TrainConfig:
    seed: int = 42
    micro_batch_size: int = 2
    grad_accum_steps: int = 1
    epochs: int = 1
    max_steps: int = -1
    stop_at_step: int = -1
    activation_checkpointing: bool = True  # recompute each decoder layer in backward (transformers' own)
    log_every: int = 10
    eval_every: int = 0


@dataclass
class CheckpointConfig:
    every_steps: int = 500  # 0: only at the end (and at stop_at_step); -1: never (benchmarks)
    keep_last: int = 2
    resume: str = "auto"
    export_adapter: bool = True
    export_merged: bool = False  # also <output_dir>/merged: base + adapter folded in (needs model.pretrained)


@dataclass
class Config:
    output_dir: str = "outputs/nemotron-nano-lora"
    run_name: str = "nemotron-nano-lora"
    mlflow: bool = True
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoraSection = field(default_factory=LoraSection)
    moe: MoESection = field(default_factory=MoESection)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


MAY_CHANGE = ("output_dir", "run_name", "mlflow", "model.lazy_load", "train.stop_at_step", "train.log_every", "train.eval_every",
              "data.num_workers", "data.max_dropped_fraction", "checkpoint.*")


def check_config(cfg: Config, config_dir: Path) -> None:
    """Resolve paths against the config file's folder and reject values that are wrong on their own."""
    cfg.model.name_or_path = resolve_path(cfg.model.name_or_path, config_dir)
    cfg.model.tokenizer = resolve_path(cfg.model.tokenizer or cfg.model.name_or_path, config_dir)
    cfg.data.train_files = [resolve_path(f, config_dir) for f in cfg.data.train_files]
    cfg.data.eval_files = [resolve_path(f, config_dir) for f in cfg.data.eval_files]
    check_fields(cfg, at_least={"parallel.ep": 1, "lora.r": 1, "train.micro_batch_size": 1, "train.grad_accum_steps": 1,
                                "train.log_every": 1, "data.max_length": 1, "moe.aux_loss_coef": 0,
                                "checkpoint.keep_last": 0, "checkpoint.every_steps": -1},
                 one_of={"parallel.param_dtype": sorted(DTYPES), "parallel.reduce_dtype": sorted(DTYPES),
                         "optim.scheduler": [t.value for t in SchedulerType]},
                 within={"lora.dropout": "[0, 1)", "data.eval_fraction": "[0, 1)", "data.max_dropped_fraction": "[0, 1]"},
                 notes={"checkpoint.every_steps": "-1: never", "data.eval_fraction": "0: no evaluation"})
    if not cfg.lora.target_modules and not cfg.lora.target_parameters:
        raise ConfigError("lora.target_modules and lora.target_parameters are both empty: nothing would train")
    if cfg.lora.dropout > 0 and cfg.lora.target_parameters:
        raise ConfigError("lora.dropout > 0 is not supported by PEFT for lora.target_parameters (expert weights): set 0")
    if cfg.train.max_steps <= 0 and cfg.train.epochs <= 0:
        raise ConfigError("set train.max_steps > 0 or train.epochs > 0")
    if cfg.checkpoint.every_steps == -1 and cfg.train.stop_at_step > 0:
        raise ConfigError("train.stop_at_step needs a checkpoint to resume from: checkpoint.every_steps=-1 saves none")
    if cfg.checkpoint.export_merged and not (cfg.model.pretrained and cfg.checkpoint.export_adapter):
        raise ConfigError("checkpoint.export_merged=true folds the adapter into the base weights read from "
                          "model.name_or_path: it needs model.pretrained=true and checkpoint.export_adapter=true")
    for key, value in [("data.image_min_pixels", cfg.data.image_min_pixels), ("data.image_max_pixels", cfg.data.image_max_pixels)]:
        if value is not None and value < 1:
            raise ConfigError(f"{key} must be >= 1 or null, got {value}")


def _matches(name: str, target: str) -> bool:
    """PEFT's rule for a target given as a name: the whole name, or its dotted tail."""
    return name == target or name.endswith("." + target)


def check_model(cfg: Config, hf_config, world_size: int) -> None:
    """Refuse an EP degree that does not fit the model or the job, and LoRA targets that match nothing,
    on the model built on the meta device (no memory, a second even for 30 B parameters)."""
    with torch.device("meta"):
        model = model_class(hf_config).from_config(hf_config)
    experts = [m for _, m in moe_blocks(model)]
    ep = cfg.parallel.ep
    if ep > 1 and not experts:
        raise ConfigError(f"parallel.ep={ep} but {cfg.model.name_or_path} ({hf_config.model_type}) has no MoE layers with "
                          f"fused experts: use parallel.ep=1")
    if world_size % ep:
        raise ConfigError(f"parallel.ep={ep} does not divide the world size {world_size} (NGPU x NNODES)")
    if experts and experts[0].experts.num_experts % ep:
        raise ConfigError(f"parallel.ep={ep} does not divide the {experts[0].experts.num_experts} experts of each MoE layer")
    modules = [n for n, _ in model.named_modules()]
    params = [n for n, _ in model.named_parameters()]
    for key, names, wanted in [("lora.target_modules", modules, cfg.lora.target_modules),
                               ("lora.target_parameters", params, cfg.lora.target_parameters)]:
        for target in wanted:
            if not any(_matches(n, target) for n in names):
                tails = sorted({".".join(n.split(".")[-2:]) for n in names if ".layers.0." in n or ".layers.1." in n})
                raise ConfigError(f"{key}: {target!r} matches nothing in {hf_config.model_type}; names in its first "
                                  f"layers end with: {', '.join(tails)}")
        if key == "lora.target_parameters":
            for target in wanted:
                if any(_matches(n, target) and model.get_parameter(n).ndim != 3 for n in names):
                    raise ConfigError(f"lora.target_parameters: {target!r} is not a fused 3-D expert weight; put "
                                      f"linear layers in lora.target_modules")


# ----------------------------------------------------------------------------- data
def collate(rows: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Packed rows (equal length, with ``position_ids``) are stacked; other rows are right-padded."""
    if "position_ids" in rows[0]:
        return {k: torch.tensor([r[k] for r in rows], dtype=torch.long) for k in ("input_ids", "labels", "position_ids")}
    return sft.pad_batch(rows, pad_id, pad_to_multiple_of=8)


# ----------------------------------------------------------------------------- data: image + text pairs (vision-language models)
def is_vision_language(hf_config) -> bool:
    """A model with a vision tower (``qwen3_vl_moe``): image + text rows, image processor, frozen vision blocks."""
    return getattr(hf_config, "vision_config", None) is not None


@dataclass
class VLSource:
    """The rows of one data file or hub data set of image + text pairs; image paths are relative to ``base_dir``."""
    name: str
    rows: Any  # list[dict] (a JSON / JSONL file) or a datasets.Dataset (rows and their images read on access)
    base_dir: Path | None = None


def to_vl_messages(row: dict, where: str) -> tuple[list[dict], list[Any]]:
    """One image + text row -> chat messages and the row's images, in the order their image parts appear.

    Formats (an image is a path, relative to the data file's folder, or a PIL image from a hub data set):
        ``{"images": [image, ...], "messages": [{"role", "content": str | [part, ...]}, ...]}`` with parts
        ``{"type": "image"}`` (takes the next image) and ``{"type": "text", "text": str}``: the layout of TRL
        and of HuggingFaceH4/llava-instruct-mix-vsft;
        ``{"image": image, "messages": [...]}``: one image. Images without image parts go before the first
        user turn's text.

    Returns:
        ``(messages, images)``: user turns hold lists of parts, system and assistant turns strings.

    Raises:
        SFTDataError: ``"<where>: ..."``: the row has no image; images and image parts differ in number; an
            image part outside a user turn; an unknown role or part; no assistant turn or an empty one.
    """
    images = row.get("images", row.get("image"))
    images = images if isinstance(images, list) else [] if images is None else [images]
    if not images or any(im is None for im in images):
        raise SFTDataError(f"{where}: no image ('images': [...] or 'image' missing, empty or null); this data path "
                           f"trains on image + text pairs")
    turns = row.get("messages")
    if not isinstance(turns, list) or not turns:
        raise SFTDataError(f"{where}: field 'messages' must be a non-empty list of turns")
    messages, n_parts = [], 0
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or turn.get("role") not in sft.ROLES or "content" not in turn:
            raise SFTDataError(f"{where}: messages[{i}] must be an object with 'role' (one of "
                               f"{', '.join(sft.ROLES)}) and 'content'")
        content = turn["content"]
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        if not isinstance(content, list):
            raise SFTDataError(f"{where}: messages[{i}].content must be a string or a list of parts")
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image" and turn["role"] == "user":
                parts.append({"type": "image"})
                n_parts += 1
            elif kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            else:
                raise SFTDataError(f"{where}: messages[{i}].content[{j}] must be {{'type': 'text', 'text': str}} or, in "
                                   f"a user turn, {{'type': 'image'}}; got {part!r:.80}")
        if turn["role"] == "user":
            messages.append({"role": "user", "content": parts})
        else:
            messages.append({"role": turn["role"], "content": "".join(p["text"] for p in parts)})
            if turn["role"] == "assistant" and not messages[-1]["content"].strip():
                raise SFTDataError(f"{where}: messages[{i}] is an empty assistant turn")
    if n_parts == 0:
        first_user = next((m for m in messages if m["role"] == "user"), None)
        if first_user is None:
            raise SFTDataError(f"{where}: no user turn to hold the image")
        first_user["content"] = [{"type": "image"}] * len(images) + first_user["content"]
    elif n_parts != len(images):
        raise SFTDataError(f"{where}: {len(images)} image(s) but {n_parts} {{'type': 'image'}} part(s) in the messages")
    if messages[0]["role"] == "assistant" or not any(m["role"] == "assistant" for m in messages):
        raise SFTDataError(f"{where}: a conversation must start with a system or user turn and hold an assistant turn")
    return messages, images


def open_image(ref: Any, base_dir: Path | None, where: str):
    """Decode one image (a path or a PIL image) to RGB. Raises SFTDataError naming the row and the file."""
    from PIL import Image

    if isinstance(ref, Image.Image):
        return ref.convert("RGB")
    if not isinstance(ref, str):
        raise SFTDataError(f"{where}: an image must be a file path or a PIL image, got {type(ref).__name__}")
    path = Path(ref) if base_dir is None or Path(ref).is_absolute() else base_dir / ref
    if not path.is_file():
        raise SFTDataError(f"{where}: image file not found: {path}")
    try:
        with Image.open(path) as img:
            return img.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as exc:  # UnidentifiedImageError is an OSError
        raise SFTDataError(f"{where}: cannot decode image {path}: {exc}") from None


def vl_example(row: dict, where: str, base_dir: Path | None, tokenizer, image_processor, image_token_id: int,
               max_length: int, template_kwargs: dict | None = None, no_loss: bool = False) -> dict[str, Any]:
    """One image + text row -> model inputs: the chat rendered and tokenized with assistant-only labels
    (`sft.tokenize_conversation`), each image placeholder token repeated once per merged image patch
    (what the Qwen-VL processors do), the images resized and cut into patches by the image processor.

    Returns:
        ``input_ids``, ``labels`` (lists of L <= max_length ints; ``no_loss``: all -100), ``pixel_values``
        (P, C * T * p * p) for the P patches of all images, ``image_grid_thw`` (n_images, 3) patch grids.

    Raises:
        SFTDataError: ``"<where>: ..."``: see `to_vl_messages` and `open_image`; the template wrote another
            number of image placeholders; the image tokens do not fit in max_length.
    """
    messages, refs = to_vl_messages(row, where)
    images = [open_image(ref, base_dir, where) for ref in refs]
    try:
        ids, labels, _ = sft.tokenize_conversation(tokenizer, messages, 1 << 30, template_kwargs)
    except SFTDataError as exc:
        raise SFTDataError(f"{where}: {exc}") from None
    if ids.count(image_token_id) != len(images):
        raise SFTDataError(f"{where}: the chat template wrote {ids.count(image_token_id)} image placeholder tokens "
                           f"(id {image_token_id}) for {len(images)} image(s): use the model's own chat template")
    pixels = image_processor(images=images, return_tensors="pt")
    counts = iter((pixels["image_grid_thw"].prod(-1) // image_processor.merge_size ** 2).tolist())
    out_ids, out_labels = [], []
    for token, label in zip(ids, labels):
        n = next(counts) if token == image_token_id else 1
        out_ids += [token] * n
        out_labels += [label if n == 1 and token != image_token_id else sft.IGNORE_INDEX] * n
    if len(out_ids) > max_length:
        last = len(out_ids) - out_ids[::-1].index(image_token_id)
        if last > max_length:
            raise SFTDataError(f"{where}: its image tokens reach token {last}, beyond data.max_length={max_length}: "
                               f"raise data.max_length or lower data.image_max_pixels")
        out_ids, out_labels = out_ids[:max_length], out_labels[:max_length]
    if no_loss:
        out_labels = [sft.IGNORE_INDEX] * len(out_ids)
    return {"input_ids": out_ids, "labels": out_labels, "pixel_values": pixels["pixel_values"],
            "image_grid_thw": pixels["image_grid_thw"]}


class VLDataset(torch.utils.data.Dataset):
    """Image + text rows, tokenized and their images decoded when read (in the DataLoader's workers).

    Args:
        items: ``(source, row index, no_loss)``; ``no_loss`` rows pad evaluation shards (labels all -100).
        **kwargs: the arguments of `vl_example` after ``base_dir``.
    """

    def __init__(self, items: list[tuple[VLSource, int, bool]], **kwargs):
        self.items, self.kwargs = items, kwargs

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        source, n, no_loss = self.items[i]
        return vl_example(dict(source.rows[n]), f"{source.name} row {n + 1}", source.base_dir, no_loss=no_loss, **self.kwargs)


def load_vl_items(cfg: DataConfig, seed: int) -> tuple[list[tuple], list[tuple]]:
    """Train and eval items ``(source, row index, no_loss)`` of image + text rows: the JSON / JSONL data files, or
    the hub data set's train split (``data.hub_id``). Without eval files a seeded ``data.eval_fraction`` of each
    train source is held out, as `sft.load_examples` does for text."""
    if cfg.train_files:
        sources = [VLSource(f, sft.load_rows(f), Path(f).parent) for f in cfg.train_files]
    else:
        import datasets

        sources = [VLSource(cfg.hub_id, datasets.load_dataset(cfg.hub_id, split="train"))]
    train, evals = [], []
    for source in sources:
        order = list(range(len(source.rows)))
        if not cfg.eval_files and cfg.eval_fraction > 0:
            order = torch.randperm(len(order), generator=torch.Generator().manual_seed(seed)).tolist()
            n_eval = max(1, int(len(order) * cfg.eval_fraction))
            evals += [(source, i, False) for i in sorted(order[:n_eval])]
            order = sorted(order[n_eval:])
        train += [(source, i, False) for i in order]
    for f in cfg.eval_files:
        source = VLSource(f, sft.load_rows(f), Path(f).parent)
        evals += [(source, i, False) for i in range(len(source.rows))]
    return train, evals


def shard_items_for_eval(items: list[tuple], rank: int, world_size: int) -> list[tuple]:
    """This rank's evaluation items, padded with label-free copies so that every rank runs as many forwards
    (see `sft.shard_for_eval`)."""
    if not items:
        return []
    mine = items[rank::world_size]
    return mine + [(*items[0][:2], True)] * (-(-len(items) // world_size) - len(mine))


def collate_vl(rows: list[dict], pad_id: int, image_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids`` / ``labels`` / ``attention_mask`` (B, L), ``mm_token_type_ids`` (B, L; 1 on
    image tokens, which the model needs for its 3-D M-RoPE positions), and the patches of all images of the
    batch concatenated: ``pixel_values`` (P, C * T * p * p), ``image_grid_thw`` (n_images, 3)."""
    batch = sft.pad_batch(rows, pad_id, pad_to_multiple_of=8)
    batch["mm_token_type_ids"] = (batch["input_ids"] == image_token_id).long()
    batch["pixel_values"] = torch.cat([r["pixel_values"] for r in rows])
    batch["image_grid_thw"] = torch.cat([r["image_grid_thw"] for r in rows])
    return batch


def load_processors(cfg: Config, hf_config):
    """The tokenizer and, for a vision-language model, its image processor (``model.tokenizer`` folder or hub id;
    ``data.image_min_pixels`` / ``image_max_pixels`` override its resize bounds), else None."""
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer)
    if not is_vision_language(hf_config):
        return tokenizer, None
    from transformers import AutoImageProcessor

    image_processor = AutoImageProcessor.from_pretrained(cfg.model.tokenizer)
    if cfg.data.image_min_pixels or cfg.data.image_max_pixels:
        size = {"shortest_edge": cfg.data.image_min_pixels or image_processor.size["shortest_edge"],
                "longest_edge": cfg.data.image_max_pixels or image_processor.size["longest_edge"]}
        image_processor = AutoImageProcessor.from_pretrained(cfg.model.tokenizer, size=size)
    if tokenizer.chat_template is None:  # some VL repositories keep the template with the processor only
        from transformers import AutoProcessor

        tokenizer.chat_template = AutoProcessor.from_pretrained(cfg.model.tokenizer).chat_template
    return tokenizer, image_processor


# ----------------------------------------------------------------------------- expert parallelism
def moe_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, block) of every MoE block: a module with a router ``gate`` and fused ``experts``."""
    return [(n, m) for n, m in model.named_modules()
            if hasattr(m, "gate") and hasattr(getattr(m, "experts", None), "num_experts")]


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits whose backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, recv_sizes: list[int], send_sizes: list[int], group: dist.ProcessGroup) -> torch.Tensor:
        ctx.sizes, ctx.group = (send_sizes, recv_sizes), group
        out = x.new_empty(sum(recv_sizes), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv_sizes, send_sizes, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return AllToAll.apply(grad, *ctx.sizes, ctx.group), None, None, None


def ep_dispatch(experts: torch.nn.Module, local_forward, group: dist.ProcessGroup, hidden: torch.Tensor,
                top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts' forward under expert parallelism; replaces ``experts.forward`` on every rank.

    Args:
        experts: the model's experts module, holding experts [j * n, (j + 1) * n) on EP rank j, n = experts.num_experts.
        local_forward: its original forward, run on the tokens this rank receives.
        group: the EP group (ranks holding the other experts of this layer).
        hidden: (T, H) tokens of this rank. top_k_index, top_k_weights: (T, K) global expert ids, weights.

    Returns:
        (T, H): sum over k of weight[t, k] * expert[top_k_index[t, k]](hidden[t]), as the unsharded module.
    """
    per, k = experts.num_experts, top_k_index.shape[1]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, k) pairs grouped by expert, hence by destination rank
    send = torch.bincount(flat // per, minlength=dist.get_world_size(group))
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    send_sizes, recv_sizes = send.tolist(), recv.tolist()
    x = AllToAll.apply(hidden[order // k], recv_sizes, send_sizes, group)
    local_ids = flat.new_empty(sum(recv_sizes))
    dist.all_to_all_single(local_ids, flat[order] % per, recv_sizes, send_sizes, group=group)  # ids at the destination
    y = local_forward(x, local_ids[:, None], torch.ones(len(local_ids), 1, dtype=top_k_weights.dtype, device=x.device))
    if not len(local_ids):  # nothing to compute here: keep the experts (LoRA) in the graph for the collectives of backward
        y = y + sum(getattr(experts, n).sum() for n in experts.ep_param_names) * 0
    y = AllToAll.apply(y, send_sizes, recv_sizes, group)
    out = torch.zeros(hidden.shape, dtype=y.dtype, device=y.device)
    out.index_add_(0, order // k, y * top_k_weights.reshape(-1)[order, None].to(y.dtype))
    return out.to(hidden.dtype)


def split_experts(model: torch.nn.Module, ep_mesh: DeviceMesh) -> list[str]:
    """Keep this rank's share of every expert tensor (base weights and LoRA factors) and route tokens with
    `ep_dispatch`. PEFT's expert LoRA for E experts is lora_A (r*E, in), expert-major, and lora_B
    (out, r*E) with the expert index fastest; each is cut along its expert axis.

    Returns:
        Names of the LoRA parameters that now hold only local experts (stored per EP rank).
    """
    from peft.tuners.lora.layer import ParamWrapper

    ep, rank, local_names = ep_mesh.size(), ep_mesh.get_local_rank(), []
    for name, block in moe_blocks(model):
        wrappers, experts = [], block.experts
        while isinstance(experts, ParamWrapper):
            wrappers.append(experts)
            experts = experts.base_layer
        per = experts.num_experts // ep
        first = rank * per
        experts.ep_param_names = [n for n, p in experts.named_parameters(recurse=False) if p.ndim == 3]
        for pname in experts.ep_param_names:
            p = getattr(experts, pname)
            setattr(experts, pname, torch.nn.Parameter(p.detach()[first:first + per].clone(), requires_grad=p.requires_grad))
        for w in wrappers:
            for lora in (w.lora_A, w.lora_B):
                for adapter, layer in lora.items():
                    wt = layer.weight.detach()
                    if lora is w.lora_A:
                        wt = wt[first * w.r[adapter]:(first + per) * w.r[adapter]]
                    else:
                        wt = wt.reshape(wt.shape[0], -1, w.num_experts)[:, :, first:first + per].reshape(wt.shape[0], -1)
                    layer.weight = torch.nn.Parameter(wt.clone(), requires_grad=layer.weight.requires_grad)
                    local_names.append(f"{name}.experts.{_wrapper_path(block.experts, w)}{'lora_A' if lora is w.lora_A else 'lora_B'}.{adapter}.weight")
            w.num_experts = per
        experts.num_experts, experts.ep_first = per, first  # ep_first: where load_base_lazily starts reading
        experts.forward = partial(ep_dispatch, experts, experts.forward, ep_mesh.get_group())
    return local_names


def _wrapper_path(outer: torch.nn.Module, wrapper: torch.nn.Module) -> str:
    """Dotted path from the outermost PEFT wrapper to a nested one ('' or 'base_layer.' ...)."""
    path, m = "", outer
    while m is not wrapper:
        m, path = m.base_layer, path + "base_layer."
    return path


# ----------------------------------------------------------------------------- model
@dataclass
class Parallel:
    """The meshes: ``world`` (1-D, all ranks: dense FSDP2) and ``dp_ep`` (2-D (dp, ep): experts)."""
    world: DeviceMesh
    dp_ep: DeviceMesh
    expert_lora_names: list[str]

    @property
    def ep(self) -> int:
        return self.dp_ep["ep"].size()


def model_class(hf_config):
    """transformers' auto class for the config: image-text-to-text for vision-language models, else causal LM."""
    if is_vision_language(hf_config):
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def decoder_layers(hf_model: torch.nn.Module) -> torch.nn.ModuleList:
    """The language model's decoder layers (``model.layers``, or ``model.language_model.layers`` of a VL model)."""
    inner = hf_model.model
    return getattr(inner, "language_model", inner).layers


def vision_blocks(hf_model: torch.nn.Module) -> list[torch.nn.Module]:
    """The vision tower's transformer blocks (empty for text models)."""
    visual = getattr(hf_model.model, "visual", None)
    return list(visual.blocks) if visual is not None else []


def active_flops(model: torch.nn.Module, hf_config) -> ModelFlops:
    """FLOPs per token counting the parameters a token uses: all non-embedding parameters of the language model,
    except that a routed expert layer contributes top-k / E of its experts. Attention FLOPs for the attention
    layers only; Mamba's scan and a vision tower (it runs per image patch, not per token) are not counted."""
    routed = sum(p.numel() for _, b in moe_blocks(model) for p in b.experts.parameters())
    experts = moe_blocks(model)
    text = hf_config.get_text_config()
    frac = text.num_experts_per_tok / experts[0][1].experts.num_experts if experts else 0.0
    types = getattr(text, "layers_block_type", None) or ["full_attention"] * text.num_hidden_layers
    visual = getattr(model.model, "visual", None)
    vision = count_parameters(visual) if visual is not None else 0
    return ModelFlops(int(count_parameters(model) - vision - routed * (1 - frac)), sum(t == "full_attention" for t in types),
                      text.num_attention_heads * text.head_dim)


def init_lora(model: torch.nn.Module, seed: int) -> None:
    """(Re-)initialise every LoRA factor with PEFT's own initialisation (A: Kaiming-uniform, B: 0) from `seed`,
    in module order, on CPU: the same initial adapter whatever the load path (a model built on the meta
    device gives PEFT meta base weights, and PEFT then leaves its factors on meta) and the EP degree."""
    from peft.tuners.lora.layer import LoraLayer

    torch.manual_seed(seed)
    for module in model.modules():
        if isinstance(module, LoraLayer):
            for adapter in module.lora_A:
                for layer in (module.lora_A[adapter], module.lora_B[adapter]):
                    if layer.weight.is_meta:
                        layer.to_empty(device="cpu")
                module.reset_lora_parameters(adapter, init_lora_weights=True)


# Checkpoint key prefixes that transformers renames at load time (its conversion_mapping.py): saved -> model.
CHECKPOINT_RENAMES = {"nemotron_h": [("backbone.", "model.")]}
_PER_EXPERT_KEY = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")


@torch.no_grad()
def load_base_lazily(model: torch.nn.Module, name_or_path: str, model_type: str) -> int:
    """Fill the base weights of `model` that are still on the meta device (built with empty weights, PEFT added,
    experts split) from the safetensors checkpoint, reading only what this rank keeps: every dense tensor,
    and for fused 3-D experts only experts ``[ep_first, ep_first + num_experts)`` (``safe_open(...).get_slice``
    reads just those bytes). Persistent buffers found in the checkpoint are copied too.

    Checkpoint layouts understood (those transformers 5 converts for the models of this recipe):
    fused ``...experts.<name>`` (E, a, b), or (E, b, a), which is transposed (Qwen3-VL-MoE hub checkpoints);
    per-expert ``...experts.<e>.<name>.weight`` stacked, with ``gate_up_proj`` = concatenated ``gate_proj`` and
    ``up_proj`` rows (Qwen3-MoE, Nemotron-H); and the prefix renames of `CHECKPOINT_RENAMES`.

    Returns:
        The number of tensor elements read.

    Raises:
        ConfigError: a parameter has no tensor in the checkpoint, or one of another shape (the message names
            it and says to set ``model.lazy_load=false``).
    """
    import contextlib

    from safetensors import safe_open

    hf = model.base_model.model if hasattr(model, "base_model") else model
    experts_modules = {}
    for _, block in moe_blocks(hf):
        inner = block.experts
        while hasattr(inner, "base_layer"):  # PEFT ParamWrapper(s) around the experts
            inner = inner.base_layer
        experts_modules[id(inner)] = inner
    with contextlib.ExitStack() as stack:
        dense, per_expert = {}, {}
        for f in sorted(model_folder(name_or_path).glob("*.safetensors")):  # a folder or a hub id (cache)
            handle = stack.enter_context(safe_open(str(f), framework="pt"))
            for key in handle.keys():
                name = key
                for old, new in CHECKPOINT_RENAMES.get(model_type, []):
                    name = new + name[len(old):] if name.startswith(old) else name
                m = _PER_EXPERT_KEY.match(name)
                if m:
                    per_expert[(m[1], m[3], int(m[2]))] = (handle, key)
                else:
                    dense[name] = (handle, key)

        def missing(target: str, why: str) -> ConfigError:
            return ConfigError(f"model.lazy_load: {why} for {target} in {name_or_path}; set model.lazy_load=false to load "
                               f"the checkpoint with transformers (every rank then holds the whole model in memory first)")

        def read(target: str, module: torch.nn.Module, shape: torch.Size) -> torch.Tensor:
            if id(module) in experts_modules and len(shape) == 3:
                first, n = getattr(module, "ep_first", 0), shape[0]
                if target in dense:
                    handle, key = dense[target]
                    t = handle.get_slice(key)[first:first + n]
                    if t.shape[1:] != shape[1:] and t.shape[1:] == shape[1:][::-1]:
                        t = t.transpose(1, 2)
                else:
                    prefix, pname = target.rsplit(".", 1)
                    parts = ("gate_proj", "up_proj") if pname == "gate_up_proj" else (pname,)
                    keys = [[per_expert.get((prefix, part, e)) for part in parts] for e in range(first, first + n)]
                    if any(k is None for ks in keys for k in ks):
                        raise missing(target, f"no tensor {prefix}.<e>.{'/'.join(parts)}.weight for experts {first}..{first + n - 1}")
                    t = torch.stack([torch.cat([h.get_tensor(k) for h, k in ks]) for ks in keys])
            elif target in dense:
                handle, key = dense[target]
                t = handle.get_tensor(key)
            else:
                raise missing(target, "no tensor")
            if t.shape != shape:
                raise missing(target, f"a tensor of shape {tuple(t.shape)} instead of {tuple(shape)}")
            return t

        names: dict[int, list[str]] = {}  # tied parameters: one object under several names
        for mod_name, module in hf.named_modules():
            for pname, p in module._parameters.items():
                if p is not None and p.is_meta:
                    names.setdefault(id(p), []).append(re.sub(r"\.base_layer\b", "", f"{mod_name}.{pname}".lstrip(".")))
        done: dict[int, torch.nn.Parameter] = {}
        elements = 0
        for mod_name, module in hf.named_modules():
            for pname, p in list(module._parameters.items()):
                if p is None or not p.is_meta:
                    continue
                if id(p) not in done:
                    aliases = names[id(p)]
                    target = next((a for a in aliases if a in dense), aliases[0])
                    t = read(target, module, p.shape)
                    elements += t.numel()
                    done[id(p)] = torch.nn.Parameter(t.to(p.dtype).contiguous(), requires_grad=p.requires_grad)
                setattr(module, pname, done[id(p)])
            for bname, b in module._buffers.items():
                target = re.sub(r"\.base_layer\b", "", f"{mod_name}.{bname}".lstrip("."))
                if b is not None and bname not in module._non_persistent_buffers_set and target in dense:
                    handle, key = dense[target]
                    b.copy_(handle.get_tensor(key))
    return elements


def build_model(cfg: Config, info: cookbook.DistInfo) -> tuple[torch.nn.Module, ModelFlops, Parallel]:
    """Build the base model on every rank, add LoRA, split the experts over the ep dimension, then shard with
    FSDP2: experts over dp; decoder layers, vision blocks (frozen) and the root over all ranks.

    Base weights: ``model.pretrained=false`` random (seeded: the same on every rank), generated on the rank's
    device, so on a GPU the whole base must fit in its memory once (61 GB for a 30 B model in bf16) before
    the experts are split and the rest sharded; pretrained with
    ``model.lazy_load`` (default) built on the meta device and filled after the split by `load_base_lazily`,
    so a rank reads only its own experts; else transformers' ``from_pretrained`` of the whole model per rank.
    """
    from accelerate import init_empty_weights
    from peft import LoraConfig, get_peft_model

    on_gpu = info.device.type == "cuda"
    dtype = DTYPES[cfg.parallel.param_dtype] if on_gpu else torch.float32
    hf_config = AutoConfig.from_pretrained(cfg.model.name_or_path, attn_implementation=cfg.model.attn_implementation)
    auto = model_class(hf_config)
    lazy = cfg.model.pretrained and cfg.model.lazy_load
    torch.manual_seed(cfg.train.seed)  # same base (random init) on every rank and every EP degree
    if lazy:
        with init_empty_weights(include_buffers=False):  # parameters on meta; buffers (rotary tables) real
            model = auto.from_config(hf_config, dtype=dtype)
    elif cfg.model.pretrained:
        model = auto.from_pretrained(cfg.model.name_or_path, config=hf_config, dtype=dtype)
    else:  # random init on the GPU: seconds for 30 B parameters, where the CPU's serial generator takes minutes
        with torch.device(info.device):
            model = auto.from_config(hf_config, dtype=dtype)
    flops = active_flops(model, hf_config)
    model = get_peft_model(model, LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                                             target_modules=list(cfg.lora.target_modules) or None,
                                             target_parameters=list(cfg.lora.target_parameters) or None))
    init_lora(model, cfg.train.seed)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # LoRA factors in fp32 (the base weights stay in the compute dtype)
    if cfg.train.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    ep = cfg.parallel.ep
    world = init_device_mesh(info.device.type, (info.world_size,), mesh_dim_names=("world",))
    dp_ep = init_device_mesh(info.device.type, (info.world_size // ep, ep), mesh_dim_names=("dp", "ep"))
    names = split_experts(model, dp_ep["ep"]) if ep > 1 else []
    if lazy:
        load_base_lazily(model, cfg.model.name_or_path, hf_config.model_type)
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=DTYPES[cfg.parallel.reduce_dtype] if on_gpu else torch.float32)
    kw = dict(mp_policy=mp, reshard_after_forward=cfg.parallel.reshard_after_forward)
    hf = model.base_model.model
    for block in vision_blocks(hf):  # frozen: all-gathered for the forward, no gradients
        fully_shard(block, mesh=world, **kw)
    for layer in decoder_layers(hf):
        for _, block in moe_blocks(layer):
            fully_shard(block.experts, mesh=dp_ep["dp"], **kw)
            block.experts.set_gradient_divide_factor(float(info.world_size))  # tokens of all ranks reach these experts
        fully_shard(layer, mesh=world, **kw)
    fully_shard(model, mesh=world, **kw)
    model.to(info.device)
    return model, flops, Parallel(world, dp_ep, names)


class RouterStats:
    """Forward hooks on the routers: the load-balancing loss and the expert loads of each forward."""

    def __init__(self, model: torch.nn.Module):
        self.blocks = moe_blocks(model)
        self.records: list[tuple[torch.Tensor, torch.Tensor]] = []
        for _, block in self.blocks:
            block.gate.register_forward_hook(lambda mod, inp, out: self.records.append((out[0], out[2])))
        self.num_experts = self.blocks[0][1].gate.num_experts if self.blocks else 0
        self.loads = torch.zeros(len(self.blocks), self.num_experts, dtype=torch.float64)

    def take(self) -> torch.Tensor:
        """Mean Switch-Transformer aux loss, E * sum_e f_e * P_e (f: share of routed slots, P: mean router
        probability; sigmoid routers normalised per token), over this forward's MoE layers; adds the loads.
        A recomputed forward (activation checkpointing) records again: only the first pass is kept."""
        records, self.records = self.records[:len(self.blocks)], []
        if not records:
            return torch.zeros(())
        losses = []
        for i, (logits, idx) in enumerate(records):
            sigmoid = hasattr(self.blocks[i][1].gate, "e_score_correction_bias")
            probs = logits.float().sigmoid() if sigmoid else logits.float().softmax(-1)
            probs = probs / probs.sum(-1, keepdim=True)
            counts = torch.bincount(idx.reshape(-1), minlength=self.num_experts).to(probs.dtype)
            self.loads[i] += counts.detach().cpu().double()
            losses.append(self.num_experts * (counts / counts.sum() * probs.mean(0)).sum())
        return torch.stack(losses).mean()

    def load_metrics(self, ep: int, device: torch.device) -> dict[str, float]:
        """Load balance over the window (all ranks), then reset."""
        if not self.blocks:
            return {}
        loads = self.loads.to(device, copy=True)
        if dist.is_initialized():
            dist.all_reduce(loads)
        self.loads.zero_()
        mean = loads.mean(1).clamp(min=1.0)
        per_rank = loads.reshape(len(self.blocks), ep, -1).sum(-1)
        return {"moe/load_max_over_mean": (loads.max(1).values / mean).mean().item(),
                "moe/ep_rank_load_max_over_mean": (per_rank.max(1).values / per_rank.mean(1).clamp(min=1.0)).mean().item()}


def token_loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Summed cross entropy of next-token prediction over labelled tokens (fp32 logits). `batch`: ``input_ids``,
    ``labels`` and the other model inputs (``attention_mask`` or ``position_ids``; images for VL models)."""
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits  # (+ images)
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch["labels"][:, 1:].flatten(),
                                             ignore_index=-100, reduction="sum")


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float, device: torch.device) -> torch.Tensor:
    """Total gradient norm over all ranks, then clip. Parameters live on two meshes (world and dp), which
    torch's clip_grad_norm_ does not mix; every shard of every tensor is on exactly one rank, so the sum of
    the local squared norms over the world is the total."""
    sq = torch.zeros((), device=device, dtype=torch.float64)
    for p in params:
        if p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            sq += g.double().pow(2).sum()
    dist.all_reduce(sq)
    norm = sq.sqrt()
    if max_norm > 0:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0).float()
        for p in params:
            if p.grad is not None:
                (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).mul_(scale)
    return norm


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader, device: torch.device, router: RouterStats) -> dict[str, float]:
    """Mean loss per assistant token over the evaluation rows of every rank."""
    model.eval()
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    tokens = torch.zeros((), device=device, dtype=torch.float64)
    saved = router.loads.clone()
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        loss_sum += token_loss_sum(model, batch).double()
        router.take()
        tokens += (batch["labels"][:, 1:] != -100).sum()
    router.loads = saved  # the logged loads are those of training
    totals = cookbook.all_reduce_sum({"loss": loss_sum, "tokens": tokens}, device)
    model.train()
    return {"loss": totals["loss"] / max(totals["tokens"], 1.0), "tokens": totals["tokens"]}


# ----------------------------------------------------------------------------- checkpoint and export
class AdapterState(ModelOptimizerState):
    """LoRA weights and optimizer state, without the frozen base weights. Expert LoRA tensors hold
    different experts on different EP ranks under one name, so they are stored as ``<name>@ep<rank>``."""

    def __init__(self, model, optimizer, par: Parallel):
        super().__init__(model, optimizer, StateDictOptions(ignore_frozen_params=True, strict=False))  # DCP still needs every saved key
        self.local = set(par.expert_lora_names)
        self.suffix = f"@ep{par.dp_ep['ep'].get_local_rank()}"

    def _rename(self, state: dict[str, Any], fwd: bool) -> dict[str, Any]:
        def key(k):
            return (k + self.suffix if k in self.local else k) if fwd else k.removesuffix(self.suffix)
        out = {"model": {key(k): v for k, v in state["model"].items()}}
        if "optim" in state:
            optim = state["optim"]
            out["optim"] = {"state": {key(k): v for k, v in optim["state"].items()},
                            "param_groups": [{**g, "params": [key(k) for k in g["params"]]} for g in optim["param_groups"]]}
        return out

    def state_dict(self) -> dict[str, Any]:
        return self._rename(super().state_dict(), fwd=True)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(self._rename(state, fwd=False))


def gather_lora(model: torch.nn.Module, par: Parallel, grads: bool = False) -> dict[str, torch.Tensor]:
    """The LoRA weights (or their gradients) of the unsharded model, on CPU, keyed by parameter name: dense
    LoRA gathered from FSDP shards, expert LoRA from the EP ranks (lora_A along rows, lora_B along its
    expert-fastest columns). Collective."""
    device = torch.device("cuda", torch.cuda.current_device()) if par.world.device_type == "cuda" else torch.device("cpu")
    full = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        t = p.grad if grads else p
        t = (t.full_tensor() if isinstance(t, DTensor) else t).detach()
        if name in par.expert_lora_names:  # this EP rank's experts: gather the others' in EP-rank order
            parts = [torch.empty_like(t, device=device) for _ in range(par.ep)]
            dist.all_gather(parts, t.to(device).contiguous(), group=par.dp_ep["ep"].get_group())
            if ".lora_A." in name:
                t = torch.cat(parts, 0)
            else:
                per = model.get_submodule(name.split(".lora_B.")[0]).num_experts
                t = torch.cat([q.reshape(q.shape[0], -1, per) for q in parts], 2).reshape(t.shape[0], -1)
        full[name] = t.cpu()
    return full


def export_adapter(model: torch.nn.Module, par: Parallel, out_dir: Path) -> Path | None:
    """Write the adapter of the unsharded model in PEFT's format (``adapter_config.json``,
    ``adapter_model.safetensors``), published atomically. Collective; returns the folder on rank 0."""
    import shutil

    from cookbook.checkpoint import publish

    full = gather_lora(model, par)
    result = None
    if dist.get_rank() == 0:
        tmp = out_dir.with_name(f".tmp-{out_dir.name}")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, state_dict=full)
        publish(tmp, out_dir)
        result = out_dir
    cookbook.barrier()
    return result


def export_merged(cfg: Config, adapter_dir: Path | None, out_dir: Path) -> Path | None:
    """Write the base model with the adapter folded in (``merge_and_unload``), in the checkpoint's format, with
    the tokenizer (and image processor): a plain transformers model. Rank 0 loads the whole base model on CPU
    for it (about 2 bytes per parameter in bf16); published atomically. Collective; the folder on rank 0."""
    import shutil

    from peft import PeftModel

    from cookbook.checkpoint import publish

    result = None
    if dist.get_rank() == 0:
        hf_config = AutoConfig.from_pretrained(cfg.model.name_or_path)
        base = model_class(hf_config).from_pretrained(cfg.model.name_or_path, dtype="auto")
        merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
        tmp = out_dir.with_name(f".tmp-{out_dir.name}")
        shutil.rmtree(tmp, ignore_errors=True)
        merged.save_pretrained(tmp)
        for processor in load_processors(cfg, hf_config):
            if processor is not None:
                processor.save_pretrained(tmp)
        publish(tmp, out_dir)
        result = out_dir
    cookbook.barrier()
    return result


# ----------------------------------------------------------------------------- recipe
def preflight(cfg: Config, config_path: str) -> None:
    """What launch.sh runs in one process before torchrun starts any worker: model, EP and LoRA checks,
    tokenizer, resume, and enough data for one step (image + text rows: every row of local files tokenized
    and its images decoded)."""
    world_size = int(os.environ.get("COOKBOOK_WORLD_SIZE", "1"))  # launch.sh: NGPU x NNODES
    if cfg.model.pretrained and cfg.model.lazy_load:  # a hub id is downloaded here, once, before any worker starts
        model_folder(cfg.model.name_or_path)
    try:
        hf_config = AutoConfig.from_pretrained(cfg.model.name_or_path)
        tokenizer, image_processor = load_processors(cfg, hf_config)
    except OSError as exc:
        raise ConfigError(f"model.name_or_path / model.tokenizer: cannot load {cfg.model.name_or_path!r}: "
                          f"{str(exc).splitlines()[0]}") from None
    sft.check_vocab(tokenizer, hf_config.get_text_config().vocab_size)
    check_model(cfg, hf_config, world_size)
    on_cpu = cookbook.get_dist_info().device.type == "cpu"  # COOKBOOK_DEVICE=cpu, or no GPU
    lm.check_attention(cfg.model.attn_implementation, on_cpu)
    if cfg.data.packing and hf_config.model_type == "nemotron_h":
        raise ConfigError("data.packing=true with nemotron_h: its Mamba layers would carry state from one packed document "
                          "into the next; use data.packing=false")
    if cfg.data.packing and image_processor is not None:
        raise ConfigError(f"data.packing=true with {hf_config.model_type}: image + text rows are right-padded (the "
                          f"model computes its 3-D image positions per row); use data.packing=false")
    Checkpointer(Path(cfg.output_dir) / "checkpoints").check_resume(
        cfg.checkpoint.resume, world_size, to_dict(cfg), MAY_CHANGE, cfg.train.stop_at_step)
    if image_processor is not None:  # every row read, every image decoded, before any worker starts
        train, evals = load_vl_items(cfg.data, cfg.train.seed)
        hub = [item for item in train + evals if item[0].base_dir is None]
        checked = [item for item in train + evals if item[0].base_dir is not None] + hub[:16]  # hub: its first rows
        dataset = VLDataset(checked, tokenizer=tokenizer, image_processor=image_processor, image_token_id=hf_config.image_token_id,
                            max_length=cfg.data.max_length, template_kwargs=dict(cfg.data.chat_template_kwargs) or None)
        n_images = sum(len(dataset[i]["image_grid_thw"]) for i in range(len(dataset)))
        per_step = cfg.train.micro_batch_size * cfg.train.grad_accum_steps * world_size
        if len(train) < per_step:
            raise ConfigError(f"{len(train)} training rows are too few for one step of {cfg.train.micro_batch_size} x "
                              f"{cfg.train.grad_accum_steps} x {world_size} rows")
        print(f"config OK: {config_path} ({len(train)} train / {len(evals)} eval image + text rows; "
              f"{len(checked)} rows with {n_images} images checked)")
    elif cfg.data.train_files:
        train, evals, stats = sft.load_examples(cfg.data, tokenizer, cfg.train.seed)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        n_rows = len(sft.pack(train, cfg.data.max_length, pad_id)) if cfg.data.packing else len(train)
        per_step = cfg.train.micro_batch_size * cfg.train.grad_accum_steps * world_size
        if n_rows < per_step:
            raise ConfigError(f"{n_rows} training rows are too few for one step of {cfg.train.micro_batch_size} x "
                              f"{cfg.train.grad_accum_steps} x {world_size} rows")
        print(f"data: {stats.summary()}")
        print(f"config OK: {config_path} ({len(train)} train / {len(evals)} eval examples)")
    else:
        print(f"config OK: {config_path} (data from {cfg.data.hub_id})")


def main(argv: list[str]) -> None:
    args = cli_parser(__doc__).parse_args(argv)
    cfg = load_config(Config, args.config, args.overrides)
    check_config(cfg, Path(args.config).resolve().parent)
    if args.check:
        preflight(cfg, args.config)
        return

    # ---- set-up
    info = cookbook.init_distributed()
    log = cookbook.get_logger()
    out_dir = Path(cfg.output_dir)
    hf_config = AutoConfig.from_pretrained(cfg.model.name_or_path)
    tokenizer, image_processor = load_processors(cfg, hf_config)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if image_processor is not None:  # image + text rows, tokenized and decoded by the loader's workers
        train_items, eval_items = load_vl_items(cfg.data, cfg.train.seed)
        vl_kw = dict(tokenizer=tokenizer, image_processor=image_processor, image_token_id=hf_config.image_token_id,
                     max_length=cfg.data.max_length, template_kwargs=dict(cfg.data.chat_template_kwargs) or None)
        train_rows = VLDataset(train_items, **vl_kw)
        eval_rows = VLDataset(shard_items_for_eval(eval_items, info.rank, info.world_size), **vl_kw)
        collate_fn = partial(collate_vl, pad_id=pad_id, image_token_id=hf_config.image_token_id)
        data_summary = f"{len(train_items)} train / {len(eval_items)} eval image + text rows"
    else:
        train_ex, eval_ex, stats = sft.load_examples(cfg.data, tokenizer, cfg.train.seed)
        if cfg.data.packing:
            train_rows, eval_rows = sft.pack(train_ex, cfg.data.max_length, pad_id), sft.pack(eval_ex, cfg.data.max_length, pad_id)
        else:
            train_rows, eval_rows = train_ex, eval_ex
        eval_rows = sft.shard_for_eval(eval_rows, info.rank, info.world_size)
        collate_fn, data_summary = partial(collate, pad_id=pad_id), stats.summary()
    sampler = DistributedSampler(train_rows, num_replicas=info.world_size, rank=info.rank, shuffle=True,
                                 seed=cfg.train.seed, drop_last=True)
    loader_kw = dict(collate_fn=collate_fn, num_workers=cfg.data.num_workers, pin_memory=info.device.type == "cuda")
    train_loader = StatefulDataLoader(train_rows, batch_size=cfg.train.micro_batch_size, sampler=sampler, drop_last=True, **loader_kw)
    eval_loader = StatefulDataLoader(eval_rows, batch_size=cfg.train.micro_batch_size, **loader_kw)
    steps_per_epoch = len(train_loader) // cfg.train.grad_accum_steps
    if steps_per_epoch == 0:
        raise ConfigError(f"{len(train_rows)} training rows are too few for one step")
    max_steps = cfg.train.max_steps if cfg.train.max_steps > 0 else cfg.train.epochs * steps_per_epoch

    model, flops, par = build_model(cfg, info)
    router = RouterStats(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), eps=cfg.optim.eps,
                                  weight_decay=cfg.optim.weight_decay, foreach=False)
    scheduler = get_scheduler(cfg.optim.scheduler, optimizer, num_warmup_steps=int(cfg.optim.warmup_ratio * max_steps),
                              num_training_steps=max_steps)
    state = TrainState()
    checkpointer = Checkpointer(out_dir / "checkpoints", keep_last=cfg.checkpoint.keep_last)
    ckpt_state = {"app": AdapterState(model, optimizer, par), "scheduler": scheduler, "train": state,
                  "rank_local": RankLocalState(dataloader=train_loader, rng=RNGState())}
    resume_from = checkpointer.check_resume(cfg.checkpoint.resume, info.world_size, to_dict(cfg), MAY_CHANGE,
                                            cfg.train.stop_at_step)
    if resume_from is not None:
        checkpointer.load(resume_from, ckpt_state)
    sampler.set_epoch(state.epoch)
    stop_at = cfg.train.stop_at_step if cfg.train.stop_at_step > 0 else max_steps
    if state.step >= max_steps and (out_dir / "adapter").is_dir():
        log.info(f"already complete: {state.step} of {max_steps} steps; adapter in {out_dir / 'adapter'}, metrics in "
                 f"{out_dir / 'metrics.jsonl'}. To train again, use a new output_dir (or delete {out_dir}).")
        cookbook.destroy_distributed()
        return

    if info.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out_dir / "config.yaml")
    metrics = MetricsLogger(out_dir, info, flops=flops, run_name=cfg.run_name, experiment="moe-lora-fsdp2-ep",
                            params=to_dict(cfg), mlflow=cfg.mlflow, max_steps=max_steps)
    n_train = sum(p.numel() for p in trainable)
    log.info(f"world size {info.world_size} ({info.backend}) | mesh dp {par.dp_ep['dp'].size()} x ep {par.ep} | "
             f"{len(router.blocks)} MoE layers x {router.num_experts} experts ({router.num_experts // par.ep} per rank) | "
             f"{flops.num_params / 1e6:,.1f} M active non-embedding params | LoRA {n_train:,} trainable params on this rank | "
             f"{len(train_rows)} train rows | {max_steps} steps | data: {data_summary}")

    # ---- train loop
    data_iter = iter(train_loader)
    window_loss, window_aux, window_steps = torch.zeros((), device=info.device), torch.zeros((), device=info.device), 0
    failed = stopped = False
    try:
        cookbook.barrier()
        metrics.start(state.step)
        while state.step < min(max_steps, stop_at):
            micro_batches, waits = [], []
            for _ in range(cfg.train.grad_accum_steps):
                t0 = time.perf_counter()
                try:
                    batch = next(data_iter)
                except StopIteration:
                    state.epoch += 1
                    sampler.set_epoch(state.epoch)
                    data_iter = iter(train_loader)
                    batch = next(data_iter)
                waits.append(time.perf_counter() - t0)
                micro_batches.append({k: v.to(info.device, non_blocking=True) for k, v in batch.items()})
            # Normalise by the labelled tokens of the global batch; FSDP averages gradients over ranks.
            local_tokens = sum((mb["labels"][:, 1:] != -100).sum() for mb in micro_batches)
            global_tokens = max(cookbook.all_reduce_sum({"t": local_tokens}, info.device)["t"], 1.0)
            step_loss = torch.zeros((), device=info.device)
            for mb, wait in zip(micro_batches, waits):
                loss_sum = token_loss_sum(model, mb)
                aux = router.take().to(info.device)
                loss = loss_sum * info.world_size / global_tokens
                if cfg.moe.aux_loss_coef > 0:
                    loss = loss + cfg.moe.aux_loss_coef * aux / cfg.train.grad_accum_steps
                loss.backward()
                router.take()  # drop the routers' records of a recomputing backward
                step_loss += loss_sum.detach() * info.world_size / global_tokens
                window_aux += aux.detach() / cfg.train.grad_accum_steps
                metrics.add(samples=mb["input_ids"].shape[0], tokens=lm.count_tokens(mb, pad_id), data_wait_s=wait)
            grad_norm = clip_grad_norm(trainable, cfg.optim.max_grad_norm, info.device)
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            state.step += 1
            window_loss += step_loss
            window_steps += 1
            if state.step % cfg.train.log_every == 0 or state.step == max_steps:
                extra = {"moe/aux_loss": window_aux / window_steps, **router.load_metrics(par.ep, info.device)}
                metrics.log_step(state.step, window_loss / window_steps, lr, grad_norm, extra=extra)
                window_loss.zero_()
                window_aux.zero_()
                window_steps = 0
            with metrics.paused():  # not counted in the step time and throughput
                if eval_rows and cfg.train.eval_every > 0 and state.step % cfg.train.eval_every == 0 and state.step < max_steps:
                    metrics.log_eval(state.step, evaluate(model, eval_loader, info.device, router))
                if cfg.checkpoint.every_steps >= 0 and (state.step in (stop_at, max_steps) or (
                        cfg.checkpoint.every_steps > 0 and state.step % cfg.checkpoint.every_steps == 0)):
                    checkpointer.save(state.step, ckpt_state, {"epoch": state.epoch, "config": to_dict(cfg)})

        # ---- save
        if state.step < max_steps:
            stopped = True
            log.info(f"stopped at step {state.step} of {max_steps} (train.stop_at_step); to continue from "
                     f"{checkpointer.latest()}, run again without train.stop_at_step (or with a larger value)")
            return
        final_eval = evaluate(model, eval_loader, info.device, router) if eval_rows else {}
        if final_eval:
            metrics.log_eval(state.step, final_eval)
        adapter_dir = export_adapter(model, par, out_dir / "adapter") if cfg.checkpoint.export_adapter else None
        merged_dir = export_merged(cfg, adapter_dir, out_dir / "merged") if cfg.checkpoint.export_merged else None
        metrics.log_summary({"step": state.step, **{f"eval/{k}": v for k, v in final_eval.items()},
                             "adapter_dir": str(adapter_dir) if adapter_dir else None,
                             "merged_dir": str(merged_dir) if merged_dir else None, "mlflow_uri": metrics.mlflow_uri,
                             "mlflow_run_id": metrics.mlflow_run_id})
        if info.is_main:
            log.info(f"done: {state.step} steps" + (f" | eval loss {final_eval['loss']:.4f}" if final_eval else ""))
            log.info(f"metrics:     {metrics.jsonl_path}")
            log.info(f"checkpoints: {checkpointer.root}")
            if adapter_dir:
                log.info(f"adapter:     {adapter_dir} (PeftModel.from_pretrained(base_model, adapter))")
            if merged_dir:
                log.info(f"merged:      {merged_dir} (a plain transformers model)")
    except BaseException:
        failed = True
        raise
    finally:
        # ---- clean-up
        metrics.close(failed=failed, stopped=stopped)
        cookbook.destroy_distributed()


if __name__ == "__main__":
    cookbook.run_main(main, user_errors=(ConfigError, sft.SFTDataError, CheckpointError))
