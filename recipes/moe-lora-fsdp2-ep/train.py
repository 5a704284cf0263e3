"""LoRA fine-tuning of mixture-of-experts LLMs, text or image + text: dense parts sharded with FSDP2, experts
split across ranks (expert parallelism, all-to-all token dispatch in ``expert_parallel.py``).

Commands (from this folder; NGPU defaults to all visible GPUs, else 2 CPU processes):

    ./launch.sh                                            # Nemotron 3 Nano 30B-A3B (hub), EP=2 on 2 GPUs
    CONFIG_FILE=qwen3-30b-a3b.yaml ./launch.sh parallel.ep=8   # Qwen3-30B-A3B, 8 GPUs, experts on 8 ranks
    CONFIG_FILE=tiny.yaml ./launch.sh                      # tiny Nemotron-H, offline, CPU-friendly
    CONFIG_FILE=tiny.yaml ./launch.sh model.name_or_path=tiny/qwen3-moe data.packing=true
    CONFIG_FILE=qwen3-vl-30b-a3b.yaml ./launch.sh          # Qwen3-VL-30B-A3B-Instruct (hub), llava-instruct-mix, EP=2
    CONFIG_FILE=tiny-vl.yaml ./launch.sh                   # tiny Qwen3-VL-MoE on 8 ant / bee photos, offline

``build_model``: load (each rank reads the dense weights and its own experts), LoRA, meshes, split experts,
``fully_shard``; ``main``: the step with the load-balancing loss. What it supports: README.md beside this file.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field, fields
from functools import partial
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", message=".*set_vital.*")
warnings.filterwarnings("ignore", message=".*falling back to its reference PyTorch implementation.*")

import cookbook  # first: a package built for another torch is one line (cookbook.builds)
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer
from transformers import logging as hf_logging

from cookbook import lm, sft
from cookbook.checkpoint import Checkpointer, CheckpointError
from cookbook.config import ConfigError, check_fields, load_config, to_dict
from cookbook.hub import model_folder, resolve_path
from cookbook.loop import Run
from cookbook.metrics import ModelFlops
from cookbook.config import build_optimizer
import moe_model
from image_text import (
    VLDataConfig,
    VLDataset,
    check_vl_items,
    collate_vl,
    is_vision_language,
    load_vl_items,
    load_vl_processors,
    shard_items_for_eval,
    show_vl,
)
from lazy_load import load_base_lazily
from expert_parallel import (
    AdapterState,
    Meshes,
    clip_grad_norm,
    export_adapter,
    export_merged,
    frozen_if_unsharded,
    init_meshes,
    moe_blocks,
    param_groups_by_mesh,
    split_experts,
)
from moe_model import DTYPES, LoraSection, ModelConfig, MoELoraConfig, RouterStats, token_mask
from routed_lora import use_routed_lora

hf_logging.disable_progress_bar()
hf_logging.set_verbosity_error()


# ----------------------------------------------------------------------------- config
@dataclass
class DataConfig(sft.DataConfig):
    packing: bool = False  # Nemotron-H: keep false (Mamba state would flow across packed documents)


@dataclass
class Config(MoELoraConfig):  # model, parallel, lora, moe, optim, train, checkpoint: moe_model's sections
    output_dir: str = "outputs/nemotron-nano-lora"
    run_name: str = "nemotron-nano-lora"
    data: DataConfig = field(default_factory=DataConfig)


@dataclass
class VLConfig(MoELoraConfig):  # a model with a vision tower: image + text rows (image_text.py)
    output_dir: str = "outputs/qwen3-vl-30b-a3b-lora"
    run_name: str = "qwen3-vl-30b-a3b-lora"
    model: ModelConfig = field(default_factory=lambda: ModelConfig(name_or_path="Qwen/Qwen3-VL-30B-A3B-Instruct"))
    lora: LoraSection = field(
        default_factory=lambda: LoraSection(target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    )
    data: VLDataConfig = field(default_factory=VLDataConfig)


MAY_CHANGE = (*moe_model.MAY_CHANGE, *sft.MAY_CHANGE)
VL_MAY_CHANGE = moe_model.MAY_CHANGE


def config_class(path: str, overrides: list[str]) -> type[Config] | type[VLConfig]:
    """`VLConfig` when the model (``model.name_or_path`` of an override or the file) has a vision tower, else `Config`.
    A model whose config cannot be read here: `VLConfig` if the file's ``data`` has a key only it knows."""
    import yaml

    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError):
        return Config  # load_config names the problem
    raw = raw if isinstance(raw, dict) else {}
    name = next((o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("model.name_or_path=")), None)
    name = name or (raw.get("model") or {}).get("name_or_path") or ModelConfig.name_or_path
    try:
        return (
            VLConfig
            if is_vision_language(AutoConfig.from_pretrained(resolve_path(name, Path(path).resolve().parent)))
            else Config
        )
    except Exception:  # noqa: BLE001 - not found, offline: check_model / preflight say so with the schema below
        vl_only = {f.name for f in fields(VLDataConfig)} - {f.name for f in fields(DataConfig)}
        return VLConfig if vl_only & set(raw.get("data") or {}) else Config


def check_config(cfg: Config | VLConfig, config_dir: Path) -> None:
    """Resolve paths against the config file's folder and reject values that are wrong on their own."""
    moe_model.check_config(cfg, config_dir)
    if isinstance(cfg, VLConfig):
        for key, value in [
            ("data.image_min_pixels", cfg.data.image_min_pixels),
            ("data.image_max_pixels", cfg.data.image_max_pixels),
        ]:
            if value is not None and value < 1:
                raise ConfigError(f"{key} must be >= 1 or null, got {value}")
    else:
        check_fields(
            cfg, within={"data.max_dropped_fraction": "[0, 1]"}, one_of={"data.reasoning": sft.config.REASONING}
        )


def auto_class(cfg: Config | VLConfig):
    return AutoModelForImageTextToText if isinstance(cfg, VLConfig) else AutoModelForCausalLM


# ----------------------------------------------------------------------------- model
def build_model(cfg: Config | VLConfig, info: cookbook.DistInfo) -> tuple[torch.nn.Module, ModelFlops, Meshes]:
    """Build the base model on every rank (`moe_model.build_base`: random and seeded, whole from the checkpoint, or
    on the meta device), add LoRA (not on a vision tower), split the experts over the ep dimension, read a
    meta-device base shard by shard (each rank its own experts), then shard with FSDP2: experts over dp; decoder
    layers, vision blocks (frozen) and the root over all ranks (on a world of one no FSDP2, unless
    parallel.fsdp_one_rank=true)."""
    from peft import LoraConfig, get_peft_model

    vl = isinstance(cfg, VLConfig)
    on_gpu = info.device.type == "cuda"
    dtype = DTYPES[cfg.train.mixed_precision] if on_gpu else torch.float32
    hf_config = AutoConfig.from_pretrained(cfg.model.name_or_path, attn_implementation=cfg.model.attn_implementation)
    model = moe_model.build_base(auto_class(cfg), hf_config, cfg.model, dtype, info.device, cfg.train.seed)
    # the vision tower runs per patch, not per token; it stays frozen, without adapters
    flops = moe_model.active_flops(model, hf_config, exclude=model.model.visual if vl else None)
    model = get_peft_model(
        model, LoraConfig(**cfg.lora.peft_kwargs(), **({"exclude_modules": r".*\.visual\..*"} if vl else {}))
    )
    moe_model.init_lora(model, cfg.train.seed)  # the same factors whatever the EP degree; fp32
    if cfg.lora.expert_lora == "routed":  # expert LoRA on the routed tokens: grouped GEMMs, no B @ A per expert
        use_routed_lora(model)
    inner = model.base_model.model.model  # the decoder (text), or Qwen3VLMoeModel: visual, language_model
    decoder = inner.language_model if vl else inner
    if cfg.train.compile != "none":  # torch.compile each layer, or each MoE block's router and routed experts
        moe_model.compile_parts(decoder.layers, cfg.train.compile)
    if cfg.train.activation_checkpointing == "full":  # decoder layers only: no gradient flows into a vision tower
        (decoder if vl else model).gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif cfg.train.activation_checkpointing != "none":  # attention or experts of each decoder layer
        moe_model.checkpoint_parts(decoder.layers, cfg.train.activation_checkpointing)

    meshes = init_meshes(info.device.type, info.world_size, cfg.parallel.ep)  # world (all ranks), (dp, ep)
    if cfg.parallel.ep > 1:
        meshes.expert_lora_names = split_experts(model, meshes.dp_ep["ep"])
    if cfg.model.pretrained and cfg.model.lazy_load:
        load_base_lazily(model, cfg.model.name_or_path)
    if info.world_size == 1 and not cfg.parallel.fsdp_one_rank:
        # nothing to shard: no FSDP2 hooks (each compiled layer stays one graph), no all-gather copies; the base is
        # in `dtype` already, the expert LoRA (fp32) is cast to it for its GEMMs (`routed_lora`), PEFT's attention
        # LoRA runs in fp32
        return model.to(info.device), flops, meshes
    mp = MixedPrecisionPolicy(
        param_dtype=dtype, reduce_dtype=DTYPES[cfg.parallel.reduce_dtype] if on_gpu else torch.float32
    )
    for layer in decoder.layers:
        for _, block in moe_blocks(layer):
            fully_shard(
                block.experts,
                mesh=meshes.dp_ep["dp"],
                mp_policy=mp,
                reshard_after_forward=cfg.parallel.reshard_after_forward,
                ignored_params=frozen_if_unsharded(block.experts, meshes.dp_ep["dp"]),
            )  # dp = 1: base used in place
            block.experts.set_gradient_divide_factor(float(info.world_size))  # tokens of all ranks reach these experts
        fully_shard(layer, mesh=meshes.world, mp_policy=mp, reshard_after_forward=cfg.parallel.reshard_after_forward)
    for block in inner.visual.blocks if vl else ():  # frozen: all-gathered for the forward, no gradients
        fully_shard(block, mesh=meshes.world, mp_policy=mp, reshard_after_forward=cfg.parallel.reshard_after_forward)
    fully_shard(model, mesh=meshes.world, mp_policy=mp, reshard_after_forward=cfg.parallel.reshard_after_forward)
    model.to(info.device)
    return model, flops, meshes


# ----------------------------------------------------------------------------- data
@dataclass
class Rows:
    """What the loop needs of the data: rows, this rank's evaluation rows, the collate function, processors."""

    train: object
    eval: object
    has_eval: bool  # evaluation rows on any rank
    collate: object
    processors: list  # saved beside a merged export
    pad_id: int
    summary: str  # the set-up log line's data part


def text_rows(cfg: Config, info: cookbook.DistInfo) -> Rows:
    """Chat / Alpaca / ShareGPT rows (`cookbook.sft`); packing: rows of exactly max_length tokens, documents
    separated by position ids."""
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer)
    pad_id = sft.pad_token_id(tokenizer)
    train_rows, eval_rows, stats = sft.training_rows(cfg.data, tokenizer, cfg.train.seed)
    return Rows(
        train_rows,
        sft.shard_for_eval(eval_rows, info.rank, info.world_size),
        bool(eval_rows),
        partial(sft.collate, pad_id=pad_id, cu_seq_lens=False),
        [tokenizer],
        pad_id,  # sdpa: no varlen offsets
        f"{len(train_rows)} train rows | {{steps}} steps | data: {stats.summary()}",
    )


def vl_rows(cfg: VLConfig, info: cookbook.DistInfo) -> Rows:
    """Image + text rows (`image_text`), tokenized and their images decoded by the loader's workers."""
    image_token_id = AutoConfig.from_pretrained(cfg.model.name_or_path).image_token_id
    tokenizer, image_processor = load_vl_processors(
        cfg.model.tokenizer, cfg.data.image_min_pixels, cfg.data.image_max_pixels
    )
    pad_id = sft.pad_token_id(tokenizer)
    train_items, eval_items = load_vl_items(cfg.data, cfg.train.seed)
    rows_kw = dict(
        tokenizer=tokenizer,
        image_processor=image_processor,
        image_token_id=image_token_id,
        max_length=cfg.data.max_length,
        template_kwargs=dict(cfg.data.chat_template_kwargs) or None,
    )
    eval_rows = VLDataset(shard_items_for_eval(eval_items, info.rank, info.world_size), **rows_kw)
    return Rows(
        VLDataset(train_items, **rows_kw),
        eval_rows,
        bool(eval_rows),
        partial(collate_vl, pad_id=pad_id, image_token_id=image_token_id),
        [tokenizer, image_processor],
        pad_id,
        f"{len(train_items)} train / {len(eval_items)} eval image + text rows | {{steps}} steps",
    )


# ----------------------------------------------------------------------------- recipe
def preflight(cfg: Config | VLConfig, world_size: int) -> str:
    """What ``--check`` runs in one process before torchrun starts any worker (launch.sh): model, EP and LoRA checks,
    tokenizer (and image processor), enough data for one step (image + text, local files: every row tokenized and
    its images decoded; hub data: its first rows), then the resume; returns what the data holds."""
    if cfg.model.pretrained and cfg.model.lazy_load:  # a hub id is downloaded here, once, before any worker starts
        model_folder(cfg.model.name_or_path)
    if isinstance(cfg, VLConfig):
        return check_vl(cfg, world_size)
    tokenizer = sft.load_tokenizer(cfg.model.tokenizer, cfg.model.name_or_path, cfg.data.max_length)
    hf_config = AutoConfig.from_pretrained(cfg.model.name_or_path)
    moe_model.check_model(cfg, hf_config, AutoModelForCausalLM, world_size)
    lm.check_attention(cfg.model.attn_implementation, cookbook.get_dist_info().device.type == "cpu")
    if cfg.data.packing and hf_config.model_type == "nemotron_h":
        raise ConfigError(
            "data.packing=true with nemotron_h: its Mamba layers would carry state from one packed document "
            "into the next; use data.packing=false"
        )
    data = sft.check_data(
        cfg.data, tokenizer, cfg.train.seed, cfg.train.micro_batch_size, cfg.train.grad_accum_steps, world_size
    )  # before the resume: a bad row is named on a used output_dir too
    Checkpointer(Path(cfg.output_dir) / "checkpoints").check_resume(
        cfg.checkpoint.resume, world_size, to_dict(cfg), MAY_CHANGE, cfg.train.stop_at_step
    )
    return data


def check_vl(cfg: VLConfig, world_size: int) -> str:
    """`preflight` of an image + text config; returns its summary of the rows."""
    try:
        hf_config = AutoConfig.from_pretrained(cfg.model.name_or_path)
        tokenizer, image_processor = load_vl_processors(
            cfg.model.tokenizer, cfg.data.image_min_pixels, cfg.data.image_max_pixels
        )
    except OSError as exc:
        raise ConfigError(
            f"model.name_or_path / model.tokenizer: cannot load {cfg.model.name_or_path!r}: {str(exc).splitlines()[0]}"
        ) from None
    if not is_vision_language(hf_config):
        raise ConfigError(
            f"model.name_or_path: {hf_config.model_type} has no vision tower: image + text rows "
            f"(data.image_min_pixels / data.image_max_pixels) need a vision-language model"
        )
    if cfg.data.packing:
        raise ConfigError(
            f"data.packing=true with {hf_config.model_type}: image + text rows are right-padded (the "
            f"model computes its 3-D image positions per row); use data.packing=false"
        )
    sft.check_vocab(tokenizer, hf_config.get_text_config().vocab_size)
    sft.check_positions(cfg.data.max_length, hf_config, cfg.model.name_or_path)
    moe_model.check_model(cfg, hf_config, AutoModelForImageTextToText, world_size)
    lm.check_attention(cfg.model.attn_implementation, cookbook.get_dist_info().device.type == "cpu")
    train, evals = load_vl_items(cfg.data, cfg.train.seed)
    n_rows, n_images = check_vl_items(
        VLDataset(
            train + evals,
            tokenizer=tokenizer,
            image_processor=image_processor,
            image_token_id=hf_config.image_token_id,
            max_length=cfg.data.max_length,
            template_kwargs=dict(cfg.data.chat_template_kwargs) or None,
        )
    )
    if len(train) < cfg.train.micro_batch_size * cfg.train.grad_accum_steps * world_size:
        raise ConfigError(
            f"{len(train)} training rows are too few for one step of {cfg.train.micro_batch_size} x "
            f"{cfg.train.grad_accum_steps} x {world_size} rows"
        )
    Checkpointer(Path(cfg.output_dir) / "checkpoints").check_resume(
        cfg.checkpoint.resume, world_size, to_dict(cfg), VL_MAY_CHANGE, cfg.train.stop_at_step
    )
    return f"{len(train)} train / {len(evals)} eval image + text rows; {n_rows} rows with {n_images} images checked"


def show_examples(cfg: Config | VLConfig, n: int) -> str:
    """N rendered training rows per data file, what training sees (one process, no worker)."""
    if not isinstance(cfg, VLConfig):
        return sft.show_data(cfg.data, sft.load_tokenizer(cfg.model.tokenizer, cfg.model.name_or_path), n)
    tokenizer, image_processor = load_vl_processors(
        cfg.model.tokenizer, cfg.data.image_min_pixels, cfg.data.image_max_pixels
    )
    return show_vl(
        cfg.data,
        tokenizer,
        image_processor,
        AutoConfig.from_pretrained(cfg.model.name_or_path).image_token_id,
        n,
        dict(cfg.data.chat_template_kwargs) or None,
    )


def load(path: str, overrides: list[str]) -> Config | VLConfig:
    cfg = load_config(config_class(path, overrides), path, overrides)
    check_config(cfg, Path(path).resolve().parent)
    return cfg


@cookbook.cli(load, preflight, show_examples)  # --check: preflight; --show-examples N: show_examples
def main(cfg: Config | VLConfig) -> None:
    # ---- set-up
    vl = isinstance(cfg, VLConfig)
    info = cookbook.init_distributed(cfg.train.collective_timeout_s, debug_dir=Path(cfg.output_dir) / "debug")
    out_dir = Path(cfg.output_dir)
    rows = vl_rows(cfg, info) if vl else text_rows(cfg, info)
    pad_id = rows.pad_id
    sampler = DistributedSampler(  # Run calls its set_epoch at each pass (a new shuffle per epoch)
        rows.train, num_replicas=info.world_size, rank=info.rank, shuffle=True, seed=cfg.train.seed, drop_last=True
    )
    loader_kw = dict(collate_fn=rows.collate, num_workers=cfg.data.num_workers, pin_memory=info.device.type == "cuda")
    train_loader = StatefulDataLoader(
        rows.train, batch_size=cfg.train.micro_batch_size, sampler=sampler, drop_last=True, **loader_kw
    )
    eval_loader = StatefulDataLoader(rows.eval, batch_size=cfg.train.micro_batch_size, **loader_kw)
    steps_per_epoch = len(train_loader) // cfg.train.grad_accum_steps
    if steps_per_epoch == 0:
        raise ConfigError(
            f"{len(rows.train)} training rows are too few for one step of {cfg.train.micro_batch_size} x "
            f"{cfg.train.grad_accum_steps} x {info.world_size} rows"
        )
    max_steps = cfg.train.max_steps if cfg.train.max_steps > 0 else cfg.train.epochs * steps_per_epoch

    model, flops, meshes = build_model(cfg, info)
    router = RouterStats(model)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    trainable = [p for _, p in named]
    optimizer, scheduler = build_optimizer(
        cfg.optim, param_groups_by_mesh(named), max_steps, fused=info.device.type == "cuda"
    )
    n_train = sum(p.numel() for p in trainable)
    with Run(
        cfg,
        info,
        app=AdapterState(model, optimizer, meshes),
        scheduler=scheduler,
        loader=train_loader,
        resizable=False,
        may_change=VL_MAY_CHANGE if vl else MAY_CHANGE,
        max_steps=max_steps,
        experiment="moe-vl-lora-fsdp2-ep" if vl else "moe-lora-fsdp2-ep",
        flops=flops,
        final=out_dir / "adapter" if cfg.checkpoint.export_adapter else None,
        what="adapter",
        evaluate=(lambda: moe_model.evaluate(model, eval_loader, info.device, router)) if rows.has_eval else None,
        log_extra=lambda: router.load_metrics(meshes.ep, info.device),
    ) as run:
        run.say(
            f"world size {info.world_size} ({info.backend}) | mesh dp {meshes.dp_ep['dp'].size()} x ep {meshes.ep} | "
            f"{len(router.blocks)} MoE layers x {router.num_experts} experts ({router.num_experts // meshes.ep} per rank) | "
            f"{flops.num_params / 1e6:,.1f} M active non-embedding params | LoRA {n_train:,} trainable params on this rank | "
            + rows.summary.replace("{steps}", str(max_steps))
        )

        # ---- train loop
        for _ in run.steps():
            optimizer.zero_grad(set_to_none=True)  # also drops a skipped step's gradients
            micro_batches, waits = run.take(cfg.train.grad_accum_steps)
            # Normalise by the labelled tokens of the whole global batch. FSDP averages gradients over
            # ranks, so each rank scales its summed loss by world_size / global tokens.
            local_tokens = sum((mb["labels"][:, 1:] != -100).sum() for mb in micro_batches)
            global_tokens = max(cookbook.all_reduce_sum({"t": local_tokens}, info.device)["t"], 1.0)
            step_loss, step_aux = torch.zeros((), device=info.device), torch.zeros((), device=info.device)
            for mb, wait in zip(micro_batches, waits):
                loss_sum = sft.token_loss_sum(model, mb)
                aux = router.take(token_mask(mb, pad_id)).to(info.device)  # load-balancing loss, padding left out
                loss = loss_sum * info.world_size / global_tokens
                if cfg.moe.aux_loss_coef > 0:
                    loss = loss + cfg.moe.aux_loss_coef * aux / cfg.train.grad_accum_steps
                loss.backward()
                router.drop()  # the records of a recomputing backward (activation checkpointing) are not counted
                step_loss += loss_sum.detach() * info.world_size / global_tokens
                step_aux += aux.detach() / cfg.train.grad_accum_steps
                run.metrics.add(samples=mb["input_ids"].shape[0], tokens=lm.count_tokens(mb, pad_id), data_wait_s=wait)
            grad_norm = clip_grad_norm(trainable, cfg.optim.max_grad_norm, info.device)  # over both meshes
            if run.skip_step(grad_norm):
                continue  # NaN / inf: the run stops, or (train.on_nonfinite=skip) the step is dropped
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            run.end_step(step_loss, lr=lr, grad_norm=grad_norm, window={"moe/aux_loss": step_aux})

        # ---- save
        def export():
            name = auto_class(cfg).__name__
            adapter = export_adapter(model, meshes, out_dir / "adapter") if cfg.checkpoint.export_adapter else None
            merged = (
                export_merged(auto_class(cfg), cfg.model.name_or_path, adapter, out_dir / "merged", rows.processors)
                if cfg.checkpoint.export_merged
                else None
            )
            return {
                "adapter_dir": (adapter, "PeftModel.from_pretrained(base_model, adapter)"),
                "merged_dir": (merged, f"{name}.from_pretrained"),
            }

        run.finish(export=export)

    # ---- clean-up
    cookbook.destroy_distributed()


if __name__ == "__main__":
    cookbook.run_main(main, user_errors=(ConfigError, sft.SFTDataError, CheckpointError))
