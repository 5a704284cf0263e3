"""LoRA fine-tuning of mixture-of-experts LLMs: dense parts sharded with FSDP2, experts split across ranks
(expert parallelism, all-to-all token dispatch).

Commands (from this folder; NGPU defaults to all visible GPUs, else 2 CPU processes):

    ./launch.sh                                            # Nemotron 3 Nano 30B-A3B (hub), EP=2 on 2 GPUs
    CONFIG_FILE=qwen3-30b-a3b.yaml ./launch.sh parallel.ep=8   # Qwen3-30B-A3B, 8 GPUs, experts on 8 ranks
    CONFIG_FILE=tiny.yaml ./launch.sh                      # tiny Nemotron-H, offline, CPU-friendly
    CONFIG_FILE=tiny.yaml ./launch.sh model.name_or_path=tiny/qwen3-moe data.packing=true

What this recipe supports:
    - Models: Hugging Face MoE causal LMs whose experts are fused 3-D parameters (transformers 5):
      ``nemotron_h`` (hybrid Mamba-2 / attention / MoE, the default) and ``qwen3_moe``.
    - Expert parallelism (``parallel.ep``, 1 = off): a (dp, ep) device mesh; rank j of each EP group keeps
      experts [j*E/ep, (j+1)*E/ep) of every MoE layer, base weights and LoRA factors alike. Routing runs
      on every rank; each (token, expert) pair is sent to the rank that holds the expert with an autograd
      ``all_to_all_single`` (counts exchanged first), computed by the model's own expert code on the
      local experts, sent back, weighted and summed (``ep_dispatch``). Everything else is FSDP2.
    - FSDP2: ``fully_shard`` on each MoE experts module over the dp dimension (gradients divided by the
      world size), on every decoder layer and on the root over all ranks; bf16 compute with fp32
      gradient reduction on GPU; frozen base weights stored in the compute dtype, LoRA factors in fp32.
    - LoRA (PEFT): ``lora.target_modules`` (attention projections) and ``lora.target_parameters`` (the
      fused expert weights, PEFT's ``target_parameters``); rank, alpha, dropout in the config; base
      weights frozen. The adapter is created on the whole model before the experts are split, so its
      initial values do not depend on the EP degree.
    - Data (cookbook.sft_data): chat / Alpaca / ShareGPT rows, chat template, loss on assistant tokens
      only, packing (Qwen3-MoE) or right padding (Nemotron-H: Mamba layers would carry state across
      packed documents). Loss normalised by the assistant tokens of the global batch.
    - Load balancing: the Switch-Transformer auxiliary loss (mean over MoE layers) is reported every step
      and added with ``moe.aux_loss_coef`` (> 0); ``moe/load_max_over_mean`` (busiest expert / mean, mean
      over layers) and ``moe/ep_rank_load_max_over_mean`` (busiest EP rank / mean) are logged.
    - Checkpoints (cookbook.checkpoint, DCP): LoRA weights and AdamW state only (frozen weights are not
      saved), scheduler, data position, RNG, step; atomic publish; ``resume: auto``. Expert adapters are
      stored per EP rank, so a resume needs the same ``parallel.ep`` (refused otherwise, before start).
    - Export: ``<output_dir>/adapter``, the adapter of the unsharded model in PEFT's format (expert
      factors gathered from every EP rank): ``PeftModel.from_pretrained(base, adapter)``.
    - Metrics (cookbook.metrics): loss, tokens/s per GPU, MFU over the active parameters (attention,
      Mamba, shared experts, router and top-k of the routed experts), peak memory, the MoE keys above.
"""

from __future__ import annotations

import os
import sys
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
from cookbook import sft_data
from cookbook.checkpoint import Checkpointer, CheckpointError, ModelOptimizerState, RankLocalState, RNGState, TrainState
from cookbook.config import ConfigError, cli_parser, load_config, resolve_path, save_config, to_dict
from cookbook.metrics import MetricsLogger, ModelFlops, count_parameters

hf_logging.disable_progress_bar()
hf_logging.set_verbosity_error()
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


# ----------------------------------------------------------------------------- config
@dataclass
class ModelConfig:
    name_or_path: str = "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"  # hub id or local folder
    pretrained: bool = True  # False: random init from config.json (benchmarks, CI)
    tokenizer: str | None = None  # default: name_or_path
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


MAY_CHANGE = ("output_dir", "run_name", "mlflow", "train.stop_at_step", "train.log_every", "train.eval_every",
              "data.num_workers", "checkpoint.*")


def check_config(cfg: Config, config_dir: Path) -> None:
    """Resolve paths against the config file's folder and reject values that are wrong on their own."""
    cfg.model.name_or_path = resolve_path(cfg.model.name_or_path, config_dir)
    cfg.model.tokenizer = resolve_path(cfg.model.tokenizer or cfg.model.name_or_path, config_dir)
    cfg.data.train_files = [resolve_path(f, config_dir) for f in cfg.data.train_files]
    cfg.data.eval_files = [resolve_path(f, config_dir) for f in cfg.data.eval_files]
    for key, value in [("parallel.param_dtype", cfg.parallel.param_dtype), ("parallel.reduce_dtype", cfg.parallel.reduce_dtype)]:
        if value not in DTYPES:
            raise ConfigError(f"{key} must be one of {sorted(DTYPES)}, got {value!r}")
    for key, value in [("parallel.ep", cfg.parallel.ep), ("lora.r", cfg.lora.r), ("train.micro_batch_size", cfg.train.micro_batch_size),
                       ("train.grad_accum_steps", cfg.train.grad_accum_steps), ("train.log_every", cfg.train.log_every),
                       ("data.max_length", cfg.data.max_length)]:
        if value < 1:
            raise ConfigError(f"{key} must be >= 1, got {value}")
    if not cfg.lora.target_modules and not cfg.lora.target_parameters:
        raise ConfigError("lora.target_modules and lora.target_parameters are both empty: nothing would train")
    if not 0.0 <= cfg.lora.dropout < 1.0 or cfg.moe.aux_loss_coef < 0:
        raise ConfigError("lora.dropout must be in [0, 1) and moe.aux_loss_coef >= 0")
    if cfg.lora.dropout > 0 and cfg.lora.target_parameters:
        raise ConfigError("lora.dropout > 0 is not supported by PEFT for lora.target_parameters (expert weights): set 0")
    if not 0.0 <= cfg.data.eval_fraction < 1.0:
        raise ConfigError(f"data.eval_fraction must be in [0, 1), got {cfg.data.eval_fraction} (0: no evaluation)")
    if cfg.train.max_steps <= 0 and cfg.train.epochs <= 0:
        raise ConfigError("set train.max_steps > 0 or train.epochs > 0")
    if cfg.optim.scheduler not in [t.value for t in SchedulerType]:
        raise ConfigError(f"optim.scheduler={cfg.optim.scheduler!r} is not a transformers scheduler")
    if cfg.checkpoint.keep_last < 0 or cfg.checkpoint.every_steps < -1:
        raise ConfigError("checkpoint.keep_last must be >= 0 and checkpoint.every_steps >= -1 (-1: never)")
    if cfg.checkpoint.every_steps == -1 and cfg.train.stop_at_step > 0:
        raise ConfigError("train.stop_at_step needs a checkpoint to resume from: checkpoint.every_steps=-1 saves none")


def _matches(name: str, target: str) -> bool:
    """PEFT's rule for a target given as a name: the whole name, or its dotted tail."""
    return name == target or name.endswith("." + target)


def check_model(cfg: Config, hf_config, world_size: int) -> None:
    """Refuse an EP degree that does not fit the model or the job, and LoRA targets that match nothing,
    on the model built on the meta device (no memory, a second even for 30 B parameters)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
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
    return sft_data.pad_batch(rows, pad_id, pad_to_multiple_of=8)


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
        experts.num_experts = per
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


def active_flops(model: torch.nn.Module, hf_config) -> ModelFlops:
    """FLOPs per token counting the parameters a token uses: all non-embedding parameters, except that a
    routed expert layer contributes top-k / E of its experts. Attention FLOPs for the attention layers only;
    Mamba's scan is not counted (small next to its projections)."""
    routed = sum(p.numel() for _, b in moe_blocks(model) for p in b.experts.parameters())
    experts = moe_blocks(model)
    frac = hf_config.num_experts_per_tok / experts[0][1].experts.num_experts if experts else 0.0
    types = getattr(hf_config, "layers_block_type", None) or ["full_attention"] * hf_config.num_hidden_layers
    return ModelFlops(int(count_parameters(model) - routed * (1 - frac)), sum(t == "full_attention" for t in types),
                      hf_config.num_attention_heads * hf_config.head_dim)


def build_model(cfg: Config, info: cookbook.DistInfo) -> tuple[torch.nn.Module, ModelFlops, Parallel]:
    """Load (or randomly initialise) the base model on every rank, add LoRA, split the experts over the
    ep dimension, then shard with FSDP2: experts over dp, decoder layers and root over all ranks."""
    from peft import LoraConfig, get_peft_model

    on_gpu = info.device.type == "cuda"
    dtype = DTYPES[cfg.parallel.param_dtype] if on_gpu else torch.float32
    hf_config = AutoConfig.from_pretrained(cfg.model.name_or_path, attn_implementation=cfg.model.attn_implementation)
    torch.manual_seed(cfg.train.seed)  # same base (random init) and same LoRA factors on every rank and every EP degree
    if cfg.model.pretrained:
        model = AutoModelForCausalLM.from_pretrained(cfg.model.name_or_path, config=hf_config, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    flops = active_flops(model, hf_config)
    model = get_peft_model(model, LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                                             target_modules=list(cfg.lora.target_modules) or None,
                                             target_parameters=list(cfg.lora.target_parameters) or None))
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()  # LoRA factors in fp32 (the base weights stay in the compute dtype)
    if cfg.train.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    ep = cfg.parallel.ep
    world = init_device_mesh(info.device.type, (info.world_size,), mesh_dim_names=("world",))
    dp_ep = init_device_mesh(info.device.type, (info.world_size // ep, ep), mesh_dim_names=("dp", "ep"))
    names = split_experts(model, dp_ep["ep"]) if ep > 1 else []
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=DTYPES[cfg.parallel.reduce_dtype] if on_gpu else torch.float32)
    kw = dict(mp_policy=mp, reshard_after_forward=cfg.parallel.reshard_after_forward)
    layers = model.base_model.model.model.layers
    for layer in layers:
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
    """Summed cross entropy of next-token prediction over labelled tokens (fp32 logits)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                   position_ids=batch.get("position_ids"), use_cache=False).logits
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


# ----------------------------------------------------------------------------- recipe
def preflight(cfg: Config, config_path: str) -> None:
    """What launch.sh runs in one process before torchrun starts any worker: model, EP and LoRA checks,
    tokenizer, resume, and enough data for one step."""
    world_size = int(os.environ.get("COOKBOOK_WORLD_SIZE", "1"))  # launch.sh: NGPU x NNODES
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer)
        hf_config = AutoConfig.from_pretrained(cfg.model.name_or_path)
    except OSError as exc:
        raise ConfigError(f"model.name_or_path / model.tokenizer: cannot load {cfg.model.name_or_path!r}: "
                          f"{str(exc).splitlines()[0]}") from None
    sft_data.check_vocab(tokenizer, hf_config.vocab_size)
    check_model(cfg, hf_config, world_size)
    if cfg.data.packing and hf_config.model_type == "nemotron_h":
        raise ConfigError("data.packing=true with nemotron_h: its Mamba layers would carry state from one packed document "
                          "into the next; use data.packing=false")
    Checkpointer(Path(cfg.output_dir) / "checkpoints").check_resume(
        cfg.checkpoint.resume, world_size, to_dict(cfg), MAY_CHANGE, cfg.train.stop_at_step)
    if cfg.data.train_files:
        train, evals, stats = sft_data.load_examples(cfg.data, tokenizer, cfg.train.seed)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        n_rows = len(sft_data.pack(train, cfg.data.max_length, pad_id)) if cfg.data.packing else len(train)
        per_step = cfg.train.micro_batch_size * cfg.train.grad_accum_steps * world_size
        if n_rows < per_step:
            raise ConfigError(f"{n_rows} training rows are too few for one step of {cfg.train.micro_batch_size} x "
                              f"{cfg.train.grad_accum_steps} x {world_size} rows")
        print(f"config OK: {config_path} ({len(train)} train / {len(evals)} eval examples; {stats.summary()})")
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
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    train_ex, eval_ex, stats = sft_data.load_examples(cfg.data, tokenizer, cfg.train.seed)
    if cfg.data.packing:
        train_rows, eval_rows = sft_data.pack(train_ex, cfg.data.max_length, pad_id), sft_data.pack(eval_ex, cfg.data.max_length, pad_id)
    else:
        train_rows, eval_rows = train_ex, eval_ex
    sampler = DistributedSampler(train_rows, num_replicas=info.world_size, rank=info.rank, shuffle=True,
                                 seed=cfg.train.seed, drop_last=True)
    loader_kw = dict(collate_fn=partial(collate, pad_id=pad_id), num_workers=cfg.data.num_workers,
                     pin_memory=info.device.type == "cuda")
    train_loader = StatefulDataLoader(train_rows, batch_size=cfg.train.micro_batch_size, sampler=sampler, drop_last=True, **loader_kw)
    eval_loader = StatefulDataLoader(sft_data.shard_for_eval(eval_rows, info.rank, info.world_size),
                                     batch_size=cfg.train.micro_batch_size, **loader_kw)
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
        log.info(f"already complete: {state.step} of {max_steps} steps; adapter in {out_dir / 'adapter'}")
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
             f"{len(train_rows)} train rows | {max_steps} steps | data: {stats.summary()}")

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
                metrics.add(samples=mb["input_ids"].shape[0], tokens=(mb["input_ids"] != pad_id).sum(), data_wait_s=wait)
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
        metrics.log_summary({"step": state.step, **{f"eval/{k}": v for k, v in final_eval.items()},
                             "adapter_dir": str(adapter_dir) if adapter_dir else None, "mlflow_uri": metrics.mlflow_uri,
                             "mlflow_run_id": metrics.mlflow_run_id})
        if info.is_main:
            log.info(f"done: {state.step} steps" + (f" | eval loss {final_eval['loss']:.4f}" if final_eval else ""))
            log.info(f"metrics:     {metrics.jsonl_path}")
            log.info(f"checkpoints: {checkpointer.root}")
            if adapter_dir:
                log.info(f"adapter:     {adapter_dir} (PeftModel.from_pretrained(base_model, adapter))")
    except BaseException:
        failed = True
        raise
    finally:
        # ---- clean-up
        metrics.close(failed=failed, stopped=stopped)
        cookbook.destroy_distributed()


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ConfigError, sft_data.SFTDataError, CheckpointError) as exc:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
