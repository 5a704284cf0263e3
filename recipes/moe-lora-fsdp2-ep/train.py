"""LoRA fine-tuning of mixture-of-experts LLMs: dense parts sharded with FSDP2, experts split across ranks
(expert parallelism, all-to-all token dispatch).

Commands (from this folder; NGPU defaults to all visible GPUs, else 2 CPU processes):

    ./launch.sh                                            # Nemotron 3 Nano 30B-A3B (hub), EP=2 on 2 GPUs
    CONFIG_FILE=qwen3-30b-a3b.yaml ./launch.sh parallel.ep=8   # Qwen3-30B-A3B, 8 GPUs, experts on 8 ranks
    CONFIG_FILE=tiny.yaml ./launch.sh                      # tiny Nemotron-H, offline, CPU-friendly
    CONFIG_FILE=tiny.yaml ./launch.sh model.name_or_path=tiny/qwen3-moe data.packing=true

Image + text pairs on a vision-language MoE (Qwen3-VL-30B-A3B): ``../moe-vl-lora-fsdp2-ep``, the same technique.

What this recipe supports:
    - Models: Hugging Face MoE causal LMs whose experts are fused 3-D parameters (transformers 5):
      ``nemotron_h`` (hybrid Mamba-2 / attention / MoE, the default) and ``qwen3_moe``.
    - Loading (``model.pretrained``): by default each rank builds the model on the meta device and reads
      from the safetensors files only the dense weights and its own experts' slices
      (``cookbook.sft.lazy_load``); ``model.lazy_load=false`` loads the whole model per rank with transformers.
    - Expert parallelism (``parallel.ep``, 1 = off): a (dp, ep) device mesh; rank j of each EP group keeps
      experts [j*E/ep, (j+1)*E/ep) of every MoE layer, base weights and LoRA factors alike
      (``cookbook.moe.split_experts``). Routing runs on every rank; each (token, expert) pair is sent to the
      rank that holds the expert with an autograd ``all_to_all_single`` (counts exchanged first), computed on
      the local experts, sent back, weighted and summed (``ep_dispatch``).
      Everything else is FSDP2.
    - FSDP2: ``fully_shard`` on each MoE experts module over the dp dimension (gradients divided by the
      world size), on every decoder layer and on the root over all ranks; ``train.mixed_precision`` bf16
      compute with fp32 gradient reduction on GPU; frozen base weights stored in the compute dtype, LoRA
      factors in fp32.
    - LoRA (PEFT): ``lora.target_modules`` (attention projections) and ``lora.target_parameters`` (the
      fused expert weights, PEFT's ``target_parameters``); rank, alpha, dropout in the config; base
      weights frozen. The adapter is created on the whole model before the experts are split, so its
      initial values do not depend on the EP degree. ``lora.expert_lora=routed`` (default) computes the
      experts, base and LoRA, as grouped GEMMs over the tokens routed to them, x_e W_e^T + s (x_e A_e^T) B_e^T
      (``cookbook.moe.use_routed_lora``); ``peft`` runs PEFT's own forward, which folds W_e + s B_e A_e for
      every expert in every forward. Both keep PEFT's modules and adapter format.
    - Activation checkpointing (``train.activation_checkpointing``): ``full`` (each decoder layer), ``attention``
      or ``experts`` (that part of each layer, ``cookbook.moe.checkpoint_parts``), ``none``.
    - ``torch.compile`` (``train.compile``, ``cookbook.moe.compile_parts``): ``moe`` (each MoE block's router and
      routed experts, routing included; the grouped GEMMs are one custom operator, ``cookbook.moe.grouped_mm``),
      ``layers`` (each decoder layer whole, before FSDP2), ``none``.
    - Data (cookbook.sft): chat / Alpaca / ShareGPT rows, chat template, loss on assistant tokens
      only, packing (Qwen3-MoE) or right padding (Nemotron-H: Mamba layers would carry state across
      packed documents). Loss normalised by the assistant tokens of the global batch.
    - Load balancing: the Switch-Transformer auxiliary loss (mean over MoE layers) is reported every step
      and added with ``moe.aux_loss_coef`` (> 0); ``moe/load_max_over_mean`` (busiest expert / mean, mean
      over layers) and ``moe/ep_rank_load_max_over_mean`` (busiest EP rank / mean) are logged. Padding counts
      in none of them (``cookbook.moe.token_mask``).
    - Checkpoints (cookbook.checkpoint, DCP): LoRA weights and AdamW state only (frozen weights are not
      saved), scheduler, data position, RNG, step; atomic publish; ``resume: auto``. Expert adapters are
      stored per EP rank, so a resume needs the same ``parallel.ep`` (refused otherwise, before start).
    - Export: ``<output_dir>/adapter``, the adapter of the unsharded model in PEFT's format (expert
      factors gathered from every EP rank): ``PeftModel.from_pretrained(base, adapter)``; optionally
      (``checkpoint.export_merged``) ``<output_dir>/merged``, base + adapter folded in, a plain model.
    - Metrics (cookbook.metrics): loss, tokens/s per device, MFU over the active parameters (attention,
      Mamba, shared experts, router and top-k of the routed experts), peak memory, the MoE keys above.
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
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, get_scheduler
from transformers import logging as hf_logging

from cookbook import lm, moe, sft
from cookbook.checkpoint import Checkpointer, CheckpointError
from cookbook.config import ConfigError, check_fields, cli_parser, load_config, to_dict
from cookbook.hub import model_folder
from cookbook.launch import check_world_size
from cookbook.loop import EpochBatches, TrainLoop, checkpoint_state, start_run
from cookbook.metrics import ModelFlops
from cookbook.moe import DTYPES
from cookbook.sft.lazy_load import load_base_lazily
from cookbook.sft.vision import is_vision_language

hf_logging.disable_progress_bar()
hf_logging.set_verbosity_error()


# ----------------------------------------------------------------------------- config
@dataclass
class DataConfig(sft.DataConfig):
    packing: bool = False  # Nemotron-H: keep false (Mamba state would flow across packed documents)


@dataclass
class Config(moe.MoELoraConfig):  # model, parallel, lora, moe, optim, train, checkpoint: cookbook.moe's sections
    output_dir: str = "outputs/nemotron-nano-lora"
    run_name: str = "nemotron-nano-lora"
    data: DataConfig = field(default_factory=DataConfig)


MAY_CHANGE = (*moe.MAY_CHANGE, *sft.MAY_CHANGE)


def check_config(cfg: Config, config_dir: Path) -> None:
    """Resolve paths against the config file's folder and reject values that are wrong on their own."""
    moe.check_config(cfg, config_dir)
    check_fields(cfg, within={"data.max_dropped_fraction": "[0, 1]"}, one_of={"data.reasoning": sft.config.REASONING})


# ----------------------------------------------------------------------------- model
def build_model(cfg: Config, info: cookbook.DistInfo) -> tuple[torch.nn.Module, ModelFlops, moe.Meshes]:
    """Build the base model on every rank (`moe.build_base`: random and seeded, whole from the checkpoint, or on
    the meta device), add LoRA, split the experts over the ep dimension, read a meta-device base shard by shard
    (each rank its own experts), then shard with FSDP2: experts over dp; decoder layers and the root over all ranks."""
    from peft import LoraConfig, get_peft_model

    on_gpu = info.device.type == "cuda"
    dtype = DTYPES[cfg.train.mixed_precision] if on_gpu else torch.float32
    hf_config = AutoConfig.from_pretrained(cfg.model.name_or_path, attn_implementation=cfg.model.attn_implementation)
    model = moe.build_base(AutoModelForCausalLM, hf_config, cfg.model, dtype, info.device, cfg.train.seed)
    flops = moe.active_flops(model, hf_config)
    model = get_peft_model(model, LoraConfig(**cfg.lora.peft_kwargs()))
    moe.init_lora(model, cfg.train.seed)  # the same factors whatever the EP degree; fp32
    if cfg.lora.expert_lora == "routed":  # expert LoRA on the routed tokens: grouped GEMMs, no B @ A per expert
        moe.use_routed_lora(model)
    if cfg.train.compile != "none":  # torch.compile each layer, or each MoE block's router and routed experts
        moe.compile_parts(model.base_model.model.model.layers, cfg.train.compile)
    if cfg.train.activation_checkpointing == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif cfg.train.activation_checkpointing != "none":  # attention or experts of each decoder layer
        moe.checkpoint_parts(model.base_model.model.model.layers, cfg.train.activation_checkpointing)

    meshes = moe.init_meshes(info.device.type, info.world_size, cfg.parallel.ep)  # world (all ranks), (dp, ep)
    if cfg.parallel.ep > 1:
        meshes.expert_lora_names = moe.split_experts(model, meshes.dp_ep["ep"])
    if cfg.model.pretrained and cfg.model.lazy_load:
        load_base_lazily(model, cfg.model.name_or_path)
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=DTYPES[cfg.parallel.reduce_dtype] if on_gpu else torch.float32)
    for layer in model.base_model.model.model.layers:
        for _, block in moe.moe_blocks(layer):
            fully_shard(block.experts, mesh=meshes.dp_ep["dp"], mp_policy=mp, reshard_after_forward=cfg.parallel.reshard_after_forward,
                        ignored_params=moe.frozen_if_unsharded(block.experts, meshes.dp_ep["dp"]))  # dp = 1: base used in place
            block.experts.set_gradient_divide_factor(float(info.world_size))  # tokens of all ranks reach these experts
        fully_shard(layer, mesh=meshes.world, mp_policy=mp, reshard_after_forward=cfg.parallel.reshard_after_forward)
    fully_shard(model, mesh=meshes.world, mp_policy=mp, reshard_after_forward=cfg.parallel.reshard_after_forward)
    model.to(info.device)
    return model, flops, meshes


# ----------------------------------------------------------------------------- recipe
def preflight(cfg: Config, config_path: str) -> None:
    """What launch.sh runs in one process before torchrun starts any worker: model, EP and LoRA checks,
    tokenizer, resume, and enough data for one step."""
    world_size = check_world_size()  # NGPU x NNODES, as launch.sh
    if cfg.model.pretrained and cfg.model.lazy_load:  # a hub id is downloaded here, once, before any worker starts
        model_folder(cfg.model.name_or_path)
    tokenizer = sft.load_tokenizer(cfg.model.tokenizer, cfg.model.name_or_path, cfg.data.max_length)
    hf_config = AutoConfig.from_pretrained(cfg.model.name_or_path)
    if is_vision_language(hf_config):
        raise ConfigError(f"model.name_or_path: {hf_config.model_type} is a vision-language model: use the recipe "
                          f"moe-vl-lora-fsdp2-ep (image + text rows, frozen vision tower)")
    moe.check_model(cfg, hf_config, AutoModelForCausalLM, world_size)
    lm.check_attention(cfg.model.attn_implementation, cookbook.get_dist_info().device.type == "cpu")
    if cfg.data.packing and hf_config.model_type == "nemotron_h":
        raise ConfigError("data.packing=true with nemotron_h: its Mamba layers would carry state from one packed document "
                          "into the next; use data.packing=false")
    Checkpointer(Path(cfg.output_dir) / "checkpoints").check_resume(
        cfg.checkpoint.resume, world_size, to_dict(cfg), MAY_CHANGE, cfg.train.stop_at_step)
    data = sft.check_data(cfg.data, tokenizer, cfg.train.seed, cfg.train.micro_batch_size, cfg.train.grad_accum_steps,
                          world_size)
    print(f"config OK: {config_path} ({data})")


def main(argv: list[str]) -> None:
    args = cli_parser(__doc__, show_examples=True).parse_args(argv)
    cfg = load_config(Config, args.config, args.overrides)
    check_config(cfg, Path(args.config).resolve().parent)
    if args.show_examples:  # one process, no worker: what training sees
        print(sft.show_data(cfg.data, sft.load_tokenizer(cfg.model.tokenizer, cfg.model.name_or_path), args.show_examples))
        return
    if args.check:
        preflight(cfg, args.config)
        return

    # ---- set-up
    info = cookbook.init_distributed(cfg.train.collective_timeout_s, debug_dir=Path(cfg.output_dir) / "debug")
    log = cookbook.get_logger()
    out_dir = Path(cfg.output_dir)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer)
    pad_id = sft.pad_token_id(tokenizer)
    # Packing: rows of exactly max_length tokens, documents separated by position ids.
    train_rows, eval_rows, stats = sft.training_rows(cfg.data, tokenizer, cfg.train.seed)
    sampler = DistributedSampler(train_rows, num_replicas=info.world_size, rank=info.rank, shuffle=True,
                                 seed=cfg.train.seed, drop_last=True)
    loader_kw = dict(collate_fn=partial(sft.collate, pad_id=pad_id, cu_seq_lens=False),  # sdpa: no varlen offsets
                     num_workers=cfg.data.num_workers, pin_memory=info.device.type == "cuda")
    train_loader = StatefulDataLoader(train_rows, batch_size=cfg.train.micro_batch_size, sampler=sampler, drop_last=True, **loader_kw)
    eval_loader = StatefulDataLoader(sft.shard_for_eval(eval_rows, info.rank, info.world_size),
                                     batch_size=cfg.train.micro_batch_size, **loader_kw)
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
    run = start_run(cfg, info, state=state, checkpoint_state=ckpt_state, may_change=MAY_CHANGE, max_steps=max_steps,
                    experiment="moe-lora-fsdp2-ep", flops=flops,
                    final=out_dir / "adapter" if cfg.checkpoint.export_adapter else None, what="adapter")
    if run is None:  # already complete
        cookbook.destroy_distributed()
        return
    checkpointer, metrics = run
    n_train = sum(p.numel() for p in trainable)
    log.info(f"world size {info.world_size} ({info.backend}) | mesh dp {meshes.dp_ep['dp'].size()} x ep {meshes.ep} | "
             f"{len(router.blocks)} MoE layers x {router.num_experts} experts ({router.num_experts // meshes.ep} per rank) | "
             f"{flops.num_params / 1e6:,.1f} M active non-embedding params | LoRA {n_train:,} trainable params on this rank | "
             f"{len(train_rows)} train rows | {max_steps} steps | data: {stats.summary()}")

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
            merged = (moe.export_merged(AutoModelForCausalLM, cfg.model.name_or_path, adapter, out_dir / "merged", [tokenizer])
                      if cfg.checkpoint.export_merged else None)
            return {"adapter_dir": (adapter, "PeftModel.from_pretrained(base_model, adapter)"),
                    "merged_dir": (merged, "AutoModelForCausalLM.from_pretrained")}
        loop.finish(export=export)

    # ---- clean-up
    cookbook.destroy_distributed()


if __name__ == "__main__":
    cookbook.run_main(main, user_errors=(ConfigError, sft.SFTDataError, CheckpointError))
