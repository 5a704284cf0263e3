"""LoRA fine-tuning of a vision-language mixture-of-experts model on image + text pairs: the language model's
dense parts and the frozen vision tower sharded with FSDP2, its experts split across ranks (expert
parallelism, all-to-all token dispatch).

Commands (from this folder; NGPU defaults to all visible GPUs, else 2 CPU processes):

    ./launch.sh                                            # Qwen3-VL-30B-A3B-Instruct (hub), llava-instruct-mix, EP=2
    ./launch.sh data.train_files=[/data/pairs.jsonl]       # your own image + text rows
    CONFIG_FILE=tiny.yaml ./launch.sh                      # tiny Qwen3-VL-MoE on 8 ant / bee photos, offline

Text-only MoE models (Nemotron-H, Qwen3-MoE): ``../moe-lora-fsdp2-ep``, the same technique.

What this recipe supports:
    - Models: vision-language MoE models of transformers 5 whose language model has fused 3-D experts:
      ``qwen3_vl_moe`` (Qwen3-VL-30B-A3B: the Qwen3-30B-A3B language model under a 27-block vision tower).
    - Loading, expert parallelism, LoRA, load balancing, checkpoints and export as in ``moe-lora-fsdp2-ep``
      (``cookbook.moe``, ``cookbook.sft.lazy_load``): each rank reads its experts' slices of the checkpoint
      (fused and transposed in Qwen3-VL-MoE's hub layout), keeps experts [j*E/ep, (j+1)*E/ep), and sends each
      (token, expert) pair to the expert's rank with an autograd ``all_to_all_single``.
    - The vision tower is frozen and has no adapter (``exclude_modules``); each of its blocks is an FSDP2 unit
      over all ranks like a decoder layer (all-gathered for its forward, no gradients); activation
      checkpointing recomputes the decoder layers only (no gradient flows into the vision tower).
    - Data (``cookbook.sft.vision``): ``{"images": [...], "messages": [...]}`` rows (local JSON / JSONL, image
      paths relative to the file, or a hub data set), rendered with the model's chat template, loss on the
      assistant turns only; images decoded, resized within ``data.image_min_pixels`` / ``image_max_pixels``
      and cut into patches by the model's image processor in the loader's workers, one placeholder token per
      merged patch; right padding (3-D M-RoPE positions per row). Bad rows (no image, a missing or
      undecodable image file) are refused with the file and row named, by ``--check`` before any worker starts.
    - Metrics: loss, tokens/s per device, MFU over the language model's active parameters (not the vision
      tower), peak memory, ``moe/aux_loss``, ``moe/load_max_over_mean``, ``moe/ep_rank_load_max_over_mean``.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
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
from transformers import AutoConfig, AutoModelForImageTextToText, get_scheduler
from transformers import logging as hf_logging

from cookbook import lm, moe, sft
from cookbook.checkpoint import Checkpointer, CheckpointError
from cookbook.config import ConfigError, cli_parser, load_config, to_dict
from cookbook.hub import model_folder
from cookbook.launch import check_world_size
from cookbook.loop import EpochBatches, TrainLoop, checkpoint_state, start_run
from cookbook.metrics import ModelFlops
from cookbook.moe import DTYPES
from cookbook.sft.lazy_load import load_base_lazily
from cookbook.sft.vision import (VLDataConfig, VLDataset, check_vl_items, collate_vl, is_vision_language, load_vl_items,
                                 load_vl_processors, shard_items_for_eval, show_vl)

hf_logging.disable_progress_bar()
hf_logging.set_verbosity_error()


# ----------------------------------------------------------------------------- config
@dataclass
class Config(moe.MoELoraConfig):  # model, parallel, lora, moe, optim, train, checkpoint: cookbook.moe's sections
    output_dir: str = "outputs/qwen3-vl-30b-a3b-lora"
    run_name: str = "qwen3-vl-30b-a3b-lora"
    model: moe.ModelConfig = field(default_factory=lambda: moe.ModelConfig(name_or_path="Qwen/Qwen3-VL-30B-A3B-Instruct"))
    lora: moe.LoraSection = field(default_factory=lambda: moe.LoraSection(
        target_parameters=["experts.gate_up_proj", "experts.down_proj"]))
    data: VLDataConfig = field(default_factory=VLDataConfig)


def check_config(cfg: Config, config_dir: Path) -> None:
    """Resolve paths against the config file's folder and reject values that are wrong on their own."""
    moe.check_config(cfg, config_dir)
    for key, value in [("data.image_min_pixels", cfg.data.image_min_pixels), ("data.image_max_pixels", cfg.data.image_max_pixels)]:
        if value is not None and value < 1:
            raise ConfigError(f"{key} must be >= 1 or null, got {value}")


# ----------------------------------------------------------------------------- model
def build_model(cfg: Config, info: cookbook.DistInfo) -> tuple[torch.nn.Module, ModelFlops, moe.Meshes]:
    """The meshes; the base model on every rank (`moe.build_base`: random and seeded, whole from the checkpoint,
    or on the meta device); LoRA on the language model; its experts split over the ep dimension; a meta-device
    base read shard by shard (each rank its own experts); then FSDP2: experts over dp, decoder layers, vision
    blocks (frozen) and the root over all ranks."""
    from peft import LoraConfig, get_peft_model

    meshes = moe.init_meshes(info.device.type, info.world_size, cfg.parallel.ep)  # world (all ranks), (dp, ep)
    hf_config = AutoConfig.from_pretrained(cfg.model.name_or_path, attn_implementation=cfg.model.attn_implementation)
    dtype = DTYPES[cfg.train.mixed_precision] if info.device.type == "cuda" else torch.float32
    reduce_dtype = DTYPES[cfg.parallel.reduce_dtype] if info.device.type == "cuda" else torch.float32
    model = moe.build_base(AutoModelForImageTextToText, hf_config, cfg.model, dtype, info.device, cfg.train.seed)
    flops = moe.active_flops(model, hf_config, exclude=model.model.visual)  # the vision tower runs per patch, not per token
    lora = LoraConfig(**cfg.lora.peft_kwargs(),
                      exclude_modules=r".*\.visual\..*")  # the vision tower stays frozen, without adapters
    model = get_peft_model(model, lora)
    moe.init_lora(model, cfg.train.seed)  # the same factors whatever the EP degree; fp32
    if cfg.lora.expert_lora == "routed":  # expert LoRA on the routed tokens: grouped GEMMs, no B @ A per expert
        moe.use_routed_lora(model)
    if cfg.train.compile != "none":  # torch.compile each decoder layer, or each MoE block's router and routed experts
        moe.compile_parts(model.base_model.model.model.language_model.layers, cfg.train.compile)
    if cfg.parallel.ep > 1:
        meshes.expert_lora_names = moe.split_experts(model, meshes.dp_ep["ep"])
    if cfg.model.pretrained and cfg.model.lazy_load:
        load_base_lazily(model, cfg.model.name_or_path)

    inner = model.base_model.model.model  # Qwen3VLMoeModel: visual, language_model
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce_dtype)
    for layer in inner.language_model.layers:
        for _, block in moe.moe_blocks(layer):
            fully_shard(block.experts, mesh=meshes.dp_ep["dp"], mp_policy=mp, reshard_after_forward=cfg.parallel.reshard_after_forward,
                        ignored_params=moe.frozen_if_unsharded(block.experts, meshes.dp_ep["dp"]))  # dp = 1: base used in place
            block.experts.set_gradient_divide_factor(float(info.world_size))  # tokens of all ranks reach these experts
        fully_shard(layer, mesh=meshes.world, mp_policy=mp, reshard_after_forward=cfg.parallel.reshard_after_forward)
    for block in inner.visual.blocks:  # frozen: all-gathered for the forward, no gradients
        fully_shard(block, mesh=meshes.world, mp_policy=mp, reshard_after_forward=cfg.parallel.reshard_after_forward)
    fully_shard(model, mesh=meshes.world, mp_policy=mp, reshard_after_forward=cfg.parallel.reshard_after_forward)
    if cfg.train.activation_checkpointing == "full":  # decoder layers only: no gradient flows into the vision tower
        inner.language_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif cfg.train.activation_checkpointing != "none":  # attention or experts of each decoder layer
        moe.checkpoint_parts(inner.language_model.layers, cfg.train.activation_checkpointing)
    model.to(info.device)
    return model, flops, meshes


# ----------------------------------------------------------------------------- recipe
def preflight(cfg: Config, config_path: str) -> None:
    """What launch.sh runs in one process before torchrun starts any worker: model, EP and LoRA checks,
    processors, resume, and every row of local files tokenized and its images decoded (hub data: its first rows)."""
    world_size = check_world_size()  # NGPU x NNODES, as launch.sh
    if cfg.model.pretrained and cfg.model.lazy_load:  # a hub id is downloaded here, once, before any worker starts
        model_folder(cfg.model.name_or_path)
    try:
        hf_config = AutoConfig.from_pretrained(cfg.model.name_or_path)
        tokenizer, image_processor = load_vl_processors(cfg.model.tokenizer, cfg.data.image_min_pixels, cfg.data.image_max_pixels)
    except OSError as exc:
        raise ConfigError(f"model.name_or_path / model.tokenizer: cannot load {cfg.model.name_or_path!r}: "
                          f"{str(exc).splitlines()[0]}") from None
    if not is_vision_language(hf_config):
        raise ConfigError(f"model.name_or_path: {hf_config.model_type} has no vision tower: use the recipe "
                          f"moe-lora-fsdp2-ep for text-only models")
    if cfg.data.packing:
        raise ConfigError(f"data.packing=true with {hf_config.model_type}: image + text rows are right-padded (the "
                          f"model computes its 3-D image positions per row); use data.packing=false")
    sft.check_vocab(tokenizer, hf_config.get_text_config().vocab_size)
    sft.check_positions(cfg.data.max_length, hf_config, cfg.model.name_or_path)
    moe.check_model(cfg, hf_config, AutoModelForImageTextToText, world_size)
    lm.check_attention(cfg.model.attn_implementation, cookbook.get_dist_info().device.type == "cpu")
    Checkpointer(Path(cfg.output_dir) / "checkpoints").check_resume(
        cfg.checkpoint.resume, world_size, to_dict(cfg), moe.MAY_CHANGE, cfg.train.stop_at_step)
    train, evals = load_vl_items(cfg.data, cfg.train.seed)
    n_rows, n_images = check_vl_items(VLDataset(train + evals, tokenizer=tokenizer, image_processor=image_processor,
                                                image_token_id=hf_config.image_token_id, max_length=cfg.data.max_length,
                                                template_kwargs=dict(cfg.data.chat_template_kwargs) or None))
    if len(train) < cfg.train.micro_batch_size * cfg.train.grad_accum_steps * world_size:
        raise ConfigError(f"{len(train)} training rows are too few for one step of {cfg.train.micro_batch_size} x "
                          f"{cfg.train.grad_accum_steps} x {world_size} rows")
    print(f"config OK: {config_path} ({len(train)} train / {len(evals)} eval image + text rows; "
          f"{n_rows} rows with {n_images} images checked)")


def main(argv: list[str]) -> None:
    args = cli_parser(__doc__, show_examples=True).parse_args(argv)
    cfg = load_config(Config, args.config, args.overrides)
    check_config(cfg, Path(args.config).resolve().parent)
    if args.show_examples:  # one process, no worker: what training sees
        tokenizer, image_processor = load_vl_processors(cfg.model.tokenizer, cfg.data.image_min_pixels,
                                                        cfg.data.image_max_pixels)
        print(show_vl(cfg.data, tokenizer, image_processor, AutoConfig.from_pretrained(cfg.model.name_or_path).image_token_id,
                      args.show_examples, dict(cfg.data.chat_template_kwargs) or None))
        return
    if args.check:
        preflight(cfg, args.config)
        return

    # ---- set-up: image + text rows, tokenized and their images decoded by the loader's workers
    info = cookbook.init_distributed(cfg.train.collective_timeout_s, debug_dir=Path(cfg.output_dir) / "debug")
    log = cookbook.get_logger()
    out_dir = Path(cfg.output_dir)
    image_token_id = AutoConfig.from_pretrained(cfg.model.name_or_path).image_token_id
    tokenizer, image_processor = load_vl_processors(cfg.model.tokenizer, cfg.data.image_min_pixels, cfg.data.image_max_pixels)
    pad_id = sft.pad_token_id(tokenizer)
    train_items, eval_items = load_vl_items(cfg.data, cfg.train.seed)
    rows_kw = dict(tokenizer=tokenizer, image_processor=image_processor, image_token_id=image_token_id,
                   max_length=cfg.data.max_length, template_kwargs=dict(cfg.data.chat_template_kwargs) or None)
    train_rows = VLDataset(train_items, **rows_kw)
    eval_rows = VLDataset(shard_items_for_eval(eval_items, info.rank, info.world_size), **rows_kw)
    sampler = DistributedSampler(train_rows, num_replicas=info.world_size, rank=info.rank, shuffle=True,
                                 seed=cfg.train.seed, drop_last=True)
    loader_kw = dict(collate_fn=partial(collate_vl, pad_id=pad_id, image_token_id=image_token_id),
                     num_workers=cfg.data.num_workers, pin_memory=info.device.type == "cuda")
    train_loader = StatefulDataLoader(train_rows, batch_size=cfg.train.micro_batch_size, sampler=sampler, drop_last=True, **loader_kw)
    eval_loader = StatefulDataLoader(eval_rows, batch_size=cfg.train.micro_batch_size, **loader_kw)
    steps_per_epoch = len(train_loader) // cfg.train.grad_accum_steps
    if steps_per_epoch == 0:
        raise ConfigError(f"{len(train_rows)} training rows are too few for one step of {cfg.train.micro_batch_size} x "
                          f"{cfg.train.grad_accum_steps} x {info.world_size} rows")
    max_steps = cfg.train.max_steps if cfg.train.max_steps > 0 else cfg.train.epochs * steps_per_epoch

    model, flops, meshes = build_model(cfg, info)
    router = moe.RouterStats(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(moe.param_groups_by_mesh(trainable), lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), eps=cfg.optim.eps,
                                  weight_decay=cfg.optim.weight_decay, fused=info.device.type == "cuda")
    scheduler = get_scheduler(cfg.optim.scheduler, optimizer, num_warmup_steps=int(cfg.optim.warmup_ratio * max_steps),
                              num_training_steps=max_steps)
    state, ckpt_state = checkpoint_state(moe.AdapterState(model, optimizer, meshes), scheduler, train_loader, resizable=False)
    run = start_run(cfg, info, state=state, checkpoint_state=ckpt_state, may_change=moe.MAY_CHANGE, max_steps=max_steps,
                    experiment="moe-vl-lora-fsdp2-ep", flops=flops,
                    final=out_dir / "adapter" if cfg.checkpoint.export_adapter else None, what="adapter")
    if run is None:  # already complete
        cookbook.destroy_distributed()
        return
    checkpointer, metrics = run
    n_train = sum(p.numel() for p in trainable)
    log.info(f"world size {info.world_size} ({info.backend}) | mesh dp {meshes.dp_ep['dp'].size()} x ep {meshes.ep} | "
             f"{len(router.blocks)} MoE layers x {router.num_experts} experts ({router.num_experts // meshes.ep} per rank) | "
             f"{flops.num_params / 1e6:,.1f} M active non-embedding params | LoRA {n_train:,} trainable params on this rank | "
             f"{len(train_items)} train / {len(eval_items)} eval image + text rows | {max_steps} steps")

    # ---- train loop
    batches = EpochBatches(train_loader, state, sampler.set_epoch, info.device, metrics=metrics)
    loop = TrainLoop.from_config(cfg, state=state, max_steps=max_steps, metrics=metrics, checkpointer=checkpointer,
                                 checkpoint_state=ckpt_state,
                                 evaluate=(lambda: moe.evaluate(model, eval_loader, info.device, router)) if eval_rows else None,
                                 log_extra=lambda: router.load_metrics(meshes.ep, info.device))
    with loop:
        for _ in loop.steps():
            optimizer.zero_grad(set_to_none=True)  # also drops a skipped step's gradients
            micro_batches, waits = batches.take(cfg.train.grad_accum_steps)
            # Normalise by the labelled tokens of the whole global batch. FSDP averages gradients over
            # ranks, so each rank scales its summed loss by world_size / global tokens.
            local_tokens = sum((mb["labels"][:, 1:] != -100).sum() for mb in micro_batches)
            global_tokens = max(cookbook.all_reduce_sum({"t": local_tokens}, info.device)["t"], 1.0)
            step_loss, step_aux = torch.zeros((), device=info.device), torch.zeros((), device=info.device)
            for mb, wait in zip(micro_batches, waits):
                loss_sum = sft.token_loss_sum(model, mb)
                aux = router.take(moe.token_mask(mb, pad_id)).to(info.device)  # load-balancing loss, padding left out
                loss = loss_sum * info.world_size / global_tokens
                if cfg.moe.aux_loss_coef > 0:
                    loss = loss + cfg.moe.aux_loss_coef * aux / cfg.train.grad_accum_steps
                loss.backward()
                router.drop()  # the records of a recomputing backward (activation checkpointing) are not counted
                step_loss += loss_sum.detach() * info.world_size / global_tokens
                step_aux += aux.detach() / cfg.train.grad_accum_steps
                metrics.add(samples=mb["input_ids"].shape[0], tokens=lm.count_tokens(mb, pad_id), data_wait_s=wait)
            grad_norm = moe.clip_grad_norm(trainable, cfg.optim.max_grad_norm, info.device)  # over both meshes
            if loop.skip_step(grad_norm): continue  # NaN / inf: the run stops, or (train.on_nonfinite=skip) the step is dropped
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            loop.end_step(step_loss, lr=lr, grad_norm=grad_norm, window={"moe/aux_loss": step_aux})

        # ---- save
        def export():
            adapter = moe.export_adapter(model, meshes, out_dir / "adapter") if cfg.checkpoint.export_adapter else None
            merged = (moe.export_merged(AutoModelForImageTextToText, cfg.model.name_or_path, adapter, out_dir / "merged",
                                        [tokenizer, image_processor]) if cfg.checkpoint.export_merged else None)
            return {"adapter_dir": (adapter, "PeftModel.from_pretrained(base_model, adapter)"),
                    "merged_dir": (merged, "AutoModelForImageTextToText.from_pretrained")}
        loop.finish(export=export)

    # ---- clean-up
    cookbook.destroy_distributed()


if __name__ == "__main__":
    cookbook.run_main(main, user_errors=(ConfigError, sft.SFTDataError, CheckpointError))
