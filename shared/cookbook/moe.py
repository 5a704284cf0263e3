"""Mixture-of-experts LoRA training with FSDP2 and expert parallelism (EP): the mechanism the MoE recipes share.

The recipes (``recipes/moe-lora-fsdp2-ep``, ``recipes/moe-vl-lora-fsdp2-ep``) write their technique out:
the meshes, LoRA, the expert split, ``fully_shard`` and the step. This module holds what they call:

- config sections and checks every MoE LoRA recipe has (`MoELoraConfig`, `check_config`, `check_model`);
- expert parallelism on Hugging Face MoE blocks with fused 3-D experts (transformers 5): `init_meshes`,
  `split_experts` (each EP rank keeps its experts, base weights and LoRA factors) and `ep_dispatch` (tokens
  travel to their expert's rank and back with an autograd all-to-all, `AllToAll`);
- expert LoRA on the routed tokens (`use_routed_lora`): each projection of the local experts, base and LoRA, as
  grouped GEMMs over the tokens sorted by expert (`grouped_mm`), y_e = x_e W_e^T + s (x_e A_e^T) B_e^T, instead
  of PEFT's forward, which folds W_e + s B_e A_e for every expert in every forward; PEFT's modules, parameter
  names and adapter format are kept;
- activation checkpointing of one part of every decoder layer (`checkpoint_parts`: attention or MoE blocks);
- the base model on the meta device or whole (`build_base`), LoRA initialised the same for every EP degree
  (`init_lora`), active-parameter FLOPs (`active_flops`);
- router statistics and the Switch-Transformer load-balancing loss over the tokens that are not padding
  (`RouterStats`, `token_mask`);
- the gradient norm over parameters of two meshes (`clip_grad_norm`), evaluation with the routers' records left
  out (`evaluate`, over `cookbook.sft.evaluate`);
- adapter checkpoints and exports: `AdapterState` (DCP), `gather_lora`, `export_adapter`, `export_merged`.
"""

from __future__ import annotations

import re
import shutil
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

import cookbook
from cookbook.checkpoint import ModelOptimizerState, publish
from cookbook import config, sft
from cookbook.config import ConfigError, check_fields
from cookbook.metrics import ModelFlops, count_parameters

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
    reduce_dtype: str = "fp32"  # gradient reduce-scatter dtype
    reshard_after_forward: bool = True


@dataclass
class LoraSection(config.ExpertLoraConfig):
    """``lora`` of the MoE recipes: `cookbook.config.ExpertLoraConfig` (r, alpha, dropout, target_modules,
    target_parameters), Nemotron-H's experts by default, and how the expert LoRA runs."""

    target_parameters: list[str] = field(default_factory=lambda: ["mixer.experts.up_proj", "mixer.experts.down_proj"])
    expert_lora: str = "routed"  # routed: LoRA on the routed tokens with grouped GEMMs (`use_routed_lora`);
    #                              peft: PEFT's forward (base + B @ A folded for every expert, every forward)


@dataclass
class MoESection:
    aux_loss_coef: float = 0.0  # > 0 adds coef x load-balancing loss to the objective (always reported)


@dataclass
class TrainConfig(config.TrainConfig):
    activation_checkpointing: str = "full"  # none; full: recompute each decoder layer in backward (transformers' own);
    #                                         attention / experts: recompute only that part of each layer (`checkpoint_parts`)
    compile: str = "none"  # torch.compile (`compile_parts`): moe: each MoE block's router and routed experts (routing
    #                        included); layers: each decoder layer whole (per-layer, before FSDP2); none


@dataclass
class CheckpointConfig(config.CheckpointConfig):
    export_adapter: bool = True
    export_merged: bool = False  # also <output_dir>/merged: base + adapter folded in (needs model.pretrained)
    push_to_hub: str = ""  # as config.HFCheckpointConfig's: the merged model if exported, else the adapter


@dataclass
class MoELoraConfig(config.RunConfig):
    """The sections of a MoE LoRA recipe's config but ``data``, which each recipe adds."""
    output_dir: str = "outputs/moe-lora"
    run_name: str = "moe-lora"
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoraSection = field(default_factory=LoraSection)
    moe: MoESection = field(default_factory=MoESection)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


# Settings that may differ between a checkpoint and the run that resumes it (with the recipe's data keys).
MAY_CHANGE = (*config.MAY_CHANGE, "model.lazy_load", "data.num_workers", "lora.expert_lora", "train.activation_checkpointing",
              "train.compile")
ACTIVATION_CHECKPOINTING = ("none", "full", "attention", "experts")
COMPILE = ("none", "moe", "layers")


def check_config(cfg: MoELoraConfig, config_dir: Path) -> None:
    """Resolve the model, tokenizer and data file paths against the config file's folder and reject values of
    the shared sections (and ``data.max_length``, ``data.eval_fraction``) that are wrong on their own.

    Raises:
        ConfigError: the first wrong value, naming its key.
    """
    sft.resolve_paths(cfg, config_dir)  # model, tokenizer and data files beside the config file
    config.check_run(cfg)
    check_fields(cfg, at_least={"parallel.ep": 1, "lora.r": 1, "data.max_length": 1, "moe.aux_loss_coef": 0},
                 one_of={"parallel.reduce_dtype": sorted(DTYPES), "train.activation_checkpointing": ACTIVATION_CHECKPOINTING,
                         "lora.expert_lora": ("routed", "peft"), "train.compile": COMPILE},
                 within={"lora.dropout": "[0, 1)", "data.eval_fraction": "[0, 1)"},
                 notes={"data.eval_fraction": "0: no evaluation"})
    if not cfg.lora.target_modules and not cfg.lora.target_parameters:
        raise ConfigError("lora.target_modules and lora.target_parameters are both empty: nothing would train")
    if cfg.lora.dropout > 0 and cfg.lora.target_parameters:
        raise ConfigError("lora.dropout > 0 is not supported by PEFT for lora.target_parameters (expert weights): set 0")
    if cfg.train.compile != "none" and cfg.lora.expert_lora != "routed":
        raise ConfigError(f"train.compile={cfg.train.compile} compiles the routed expert LoRA: it needs lora.expert_lora=routed "
                          f"(or train.compile=none)")
    if cfg.train.compile == "layers" and cfg.train.activation_checkpointing != "none":
        # full: transformers' checkpointed layer call bypasses the compiled one (measured: no graph made, eager
        # silently); attention / experts: not tried
        raise ConfigError(f"train.compile=layers with train.activation_checkpointing={cfg.train.activation_checkpointing} "
                          f"is not supported: use train.compile=moe (works with every activation_checkpointing), or "
                          f"train.activation_checkpointing=none")
    if cfg.checkpoint.export_merged and not (cfg.model.pretrained and cfg.checkpoint.export_adapter):
        raise ConfigError("checkpoint.export_merged=true folds the adapter into the base weights read from "
                          "model.name_or_path: it needs model.pretrained=true and checkpoint.export_adapter=true")


def _matches(name: str, target: str) -> bool:
    """PEFT's rule for a target given as a name: the whole name, or its dotted tail."""
    return name == target or name.endswith("." + target)


def check_model(cfg: MoELoraConfig, hf_config, auto_class, world_size: int) -> None:
    """Refuse an EP degree that does not fit the model or the job, and LoRA targets that match nothing, on the
    model built with `auto_class` on the meta device (no memory, a second even for 30 B parameters).

    Raises:
        ConfigError: ``parallel.ep`` > 1 without MoE layers, or not dividing the world size or the experts;
            a ``lora.target_modules`` / ``lora.target_parameters`` entry matching nothing (the message lists the
            names of the first layers); a target parameter that is not a fused 3-D expert weight;
            ``lora.expert_lora=routed`` on experts whose forward `routed_experts_forward` does not reproduce.
    """
    with torch.device("meta"):
        model = auto_class.from_config(hf_config)
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
    if cfg.lora.expert_lora == "routed" and cfg.lora.target_parameters and experts:
        reason = routed_lora_unsupported(experts[0].experts)
        if reason:
            raise ConfigError(f"lora.expert_lora=routed: the experts of {hf_config.model_type} {reason}; "
                              f"use lora.expert_lora=peft")


# ----------------------------------------------------------------------------- expert parallelism
def moe_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, block) of every MoE block: a module with a router ``gate`` and fused ``experts``."""
    return [(n, m) for n, m in model.named_modules()
            if hasattr(m, "gate") and hasattr(getattr(m, "experts", None), "num_experts")]


@dataclass
class Meshes:
    """``world`` (1-D, all ranks: the dense FSDP2 units) and ``dp_ep`` (2-D (dp, ep): the experts), and the names
    of the LoRA parameters that hold only this EP rank's experts (set from `split_experts`)."""
    world: DeviceMesh
    dp_ep: DeviceMesh
    expert_lora_names: list[str] = field(default_factory=list)

    @property
    def ep(self) -> int:
        return self.dp_ep["ep"].size()


def init_meshes(device_type: str, world_size: int, ep: int) -> Meshes:
    """The device meshes of FSDP2 + EP: ``world`` (world_size,) and ``dp_ep`` (world_size // ep, ep), EP
    groups of consecutive ranks. Collective. Raises ValueError when `ep` does not divide `world_size`."""
    if world_size % ep:
        raise ValueError(f"ep={ep} does not divide the world size {world_size}")
    return Meshes(init_device_mesh(device_type, (world_size,), mesh_dim_names=("world",)),
                  init_device_mesh(device_type, (world_size // ep, ep), mesh_dim_names=("dp", "ep")))


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
        experts: the model's experts module (the outermost PEFT wrapper, if any), holding experts [j * n, (j + 1) * n)
            on EP rank j, n = experts.num_experts.
        local_forward: its forward before the split (PEFT's, or `routed_experts_forward`), run on the tokens this
            rank receives, with top-k 1 and weight 1.
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
    if not len(local_ids):  # no token here: keep x and the LoRA in the graph, for backward's all-to-all and zero gradients
        y = y + (x.sum() + sum(p.sum() for p in experts.parameters() if p.requires_grad)) * 0
    y = AllToAll.apply(y, send_sizes, recv_sizes, group)
    out = torch.zeros(hidden.shape, dtype=y.dtype, device=y.device)
    out.index_add_(0, order // k, y * top_k_weights.reshape(-1)[order, None].to(y.dtype))
    return out.to(hidden.dtype)


def _experts_chain(module: torch.nn.Module) -> tuple[list[torch.nn.Module], torch.nn.Module]:
    """(the PEFT ``ParamWrapper`` layers from the outside in, the experts module they wrap)."""
    from peft.tuners.lora.layer import ParamWrapper

    wrappers = []
    while isinstance(module, ParamWrapper):
        wrappers.append(module)
        module = module.base_layer
    return wrappers, module


def split_experts(model: torch.nn.Module, ep_mesh: DeviceMesh) -> list[str]:
    """Keep this rank's share of every expert tensor (base weights and LoRA factors) and route tokens with
    `ep_dispatch` around the experts module's forward (PEFT's, or `routed_experts_forward` when `use_routed_lora`
    ran first). PEFT's expert LoRA for E experts is lora_A (r*E, in), expert-major, and lora_B
    (out, r*E) with the expert index fastest; each is cut along its expert axis. Base weights still on the
    meta device stay there, with ``checkpoint_offset`` telling `cookbook.sft.lazy_load` where to read.

    Returns:
        Names of the LoRA parameters that now hold only local experts (stored per EP rank).
    """
    ep, rank, local_names = ep_mesh.size(), ep_mesh.get_local_rank(), []
    for name, block in moe_blocks(model):
        wrappers, experts = _experts_chain(block.experts)
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
        experts.num_experts, experts.checkpoint_offset = per, first
        block.experts.forward = partial(ep_dispatch, block.experts, block.experts.forward, ep_mesh.get_group())
    return local_names


def _wrapper_path(outer: torch.nn.Module, wrapper: torch.nn.Module) -> str:
    """Dotted path from the outermost PEFT wrapper to a nested one ('' or 'base_layer.' ...)."""
    path, m = "", outer
    while m is not wrapper:
        m, path = m.base_layer, path + "base_layer."
    return path


# ----------------------------------------------------------------------------- expert LoRA on the routed tokens
_GROUPED_MM = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
# Inductor must hand the ops below their inputs with the strides eager mode has (torch.compile of a layer once laid
# lora_B's expert-major copy out with the expert index innermost, which grouped GEMM refuses); the ops also fix an
# unusable layout themselves (`_gemm_layout`).
_EXACT_STRIDES = tuple(t for t in (getattr(torch.Tag, "needs_exact_strides", None),) if t is not None)


def _kernel_ok(x: torch.Tensor, k: int, n: int) -> bool:
    """Whether torch's grouped GEMM kernel takes these operands: CUDA, bf16, a non-empty S and 16-byte aligned
    rows (K and N multiples of 8)."""
    return _GROUPED_MM is not None and x.is_cuda and x.dtype == torch.bfloat16 and len(x) > 0 and k % 8 == 0 and n % 8 == 0


def _gemm_layout(t: torch.Tensor) -> torch.Tensor:
    """`t` itself if its last two dimensions are row- or column-major (what grouped GEMM accepts), else a
    contiguous copy."""
    s, (rows, cols) = t.stride(), t.shape[-2:]
    if (s[-1] == 1 and s[-2] >= max(1, cols)) or (s[-2] == 1 and s[-1] >= max(1, rows)):
        return t
    return t.contiguous()


@torch.library.custom_op("cookbook::grouped_mm", mutates_args=(), tags=_EXACT_STRIDES)
def _grouped_mm_op(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """(S, K) x (G, K, N) -> (S, N), rows offs[g-1]:offs[g] times w[g]; `x` and `w` of one dtype."""
    if _kernel_ok(x, w.shape[1], w.shape[2]):
        return _GROUPED_MM(_gemm_layout(x), _gemm_layout(w), offs=offs)
    ends = offs.tolist()  # the loop: CPU, fp32, unaligned or no rows; every group runs, empty ones too
    return torch.cat([x[start:end] @ w[g] for g, (start, end) in enumerate(zip([0] + ends[:-1], ends))])


@_grouped_mm_op.register_fake
def _(x, w, offs):
    return x.new_empty(x.shape[0], w.shape[2], dtype=w.dtype)


@torch.library.custom_op("cookbook::grouped_mm_weight_grad", mutates_args=(), tags=_EXACT_STRIDES)
def _grouped_mm_weight_grad_op(x: torch.Tensor, dy: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """(S, K), (S, N) -> (G, K, N): x_g^T dy_g for the rows of each group (zeros for an empty group)."""
    if _kernel_ok(x, x.shape[1], dy.shape[1]):  # torch's 2-D x 2-D form: the rows of both split by offs
        return _GROUPED_MM(_gemm_layout(x.t()), _gemm_layout(dy), offs=offs)
    ends = offs.tolist()
    return torch.stack([x[start:end].t() @ dy[start:end] for start, end in zip([0] + ends[:-1], ends)])


@_grouped_mm_weight_grad_op.register_fake
def _(x, dy, offs):
    return x.new_empty(offs.shape[0], x.shape[1], dy.shape[1])


def _grouped_mm_setup(ctx, inputs, output):
    x, w, offs = inputs
    ctx.save_for_backward(x if w.requires_grad else None, w if x.requires_grad else None, offs)


def _grouped_mm_backward(ctx, dy):
    """dX = dY W_g^T per group (the same op on the transposed weights), dW_g = X_g^T dY_g."""
    x, w, offs = ctx.saved_tensors
    dy = dy.contiguous()  # an expanded or strided gradient (sum(), a slice) is no GEMM operand
    dx = _grouped_mm_op(dy, w.transpose(1, 2), offs) if ctx.needs_input_grad[0] else None
    dw = _grouped_mm_weight_grad_op(x, dy, offs) if ctx.needs_input_grad[1] else None
    return dx, dw, None


_grouped_mm_op.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Grouped matrix product: rows ``offs[g-1]:offs[g]`` of `x` times ``w[g]``, differentiable in both.

    Under ``torch.compile``, and wherever torch's kernel does not apply, one operator,
    ``torch.ops.cookbook.grouped_mm`` (a ``torch.library.custom_op``) whose backward is grouped GEMMs too:
    dX = dY W_g^T per group, dW_g = X_g^T dY_g (``torch.ops.cookbook.grouped_mm_weight_grad``). Compiled, it stays
    one opaque node that gets the input strides eager mode gives it, and its loop fallback (which reads the
    offsets on the host) stays out of the graph. Eager with the kernel: torch's own differentiable grouped GEMM
    (no Python autograd node per call; the step is bound by the host's kernel launches).

    Args:
        x: (S, K) rows sorted by group, S = offs[-1].
        w: (G, K, N), any strides (a transposed view of (G, N, K) weights is used in place; a layout the kernel
            refuses, such as lora_B's expert-major view, is copied).
        offs: (G,) int32 cumulative row counts (end of each group; empty groups allowed).

    Returns:
        (S, N) in the dtype of `w` (`x` is cast to it). On CUDA in bf16 with 16-byte aligned rows (K and N
        multiples of 8) one kernel: ``torch.nn.functional.grouped_mm`` (torch >= 2.10), else ``torch._grouped_mm``;
        otherwise (CPU, fp32, unaligned sizes, S = 0) a loop of matrix products over the groups, which also
        runs the empty ones so that the result always depends on `x` and `w` (autograd, collectives).
    """
    x = x.to(w.dtype)
    if not torch.compiler.is_compiling() and _kernel_ok(x, w.shape[1], w.shape[2]):
        return _GROUPED_MM(x, _gemm_layout(w), offs=offs)
    return _grouped_mm_op(x, w, offs)


def routed_lora_unsupported(experts: torch.nn.Module) -> str | None:
    """Why `routed_experts_forward` would not compute what `experts` (a transformers 5 experts module, before
    PEFT) computes, or None: it reproduces the ``@use_experts_implementation`` experts without bias or post-expert
    norm (gated ``gate_up_proj`` or plain ``up_proj``, then ``down_proj``; either weight layout)."""
    if not hasattr(experts, "has_gate"):
        return "are not transformers' fused experts (@use_experts_implementation)"
    if getattr(experts, "has_bias", False) or getattr(experts, "has_post_expert_norm", False):
        return "have biases or a post-expert norm"
    return None


def _lora_factors(wrappers: list[torch.nn.Module], param: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(A (E, in, r), s B (E, r, out)) of each active, unmerged adapter on the expert parameter `param`, from
    PEFT's lora_A (r*E, in), expert-major (a view), and lora_B (out, r*E), expert index fastest, times the
    adapter's scaling s = alpha / r (one elementwise pass that writes the copy: r*E*out elements, its permuted view
    would have the expert index innermost, which grouped GEMM refuses). s (x A^T) B^T = (x A^T)(s B)^T; with s a
    power of two (alpha = 2 r, the shipped configs) the two round identically."""
    factors = []
    for w in wrappers:
        if w.parameter_name != param or w.disable_adapters or w.merged:
            continue
        for name in w.active_adapters:
            if name in w.lora_A:
                a, b, r = w.lora_A[name].weight, w.lora_B[name].weight, w.r[name]
                factors.append((a.reshape(w.num_experts, r, -1).transpose(1, 2),
                                (b.reshape(b.shape[0], r, w.num_experts).permute(2, 1, 0) * w.scaling[name]).contiguous()))
    return factors


def _expert_projection(experts, wrappers, param: str, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x (S, in) sorted by expert -> (S, out): x_e W_e^T + sum over adapters of (x_e A_e^T)(s B_e)^T, each a grouped GEMM."""
    weight = getattr(experts, param)
    y = grouped_mm(x, weight if experts.is_transposed else weight.transpose(1, 2), offs)
    for a, b in _lora_factors(wrappers, param):
        y = y + grouped_mm(grouped_mm(x, a, offs), b, offs)
    return y


def routed_experts_forward(module: torch.nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts' forward with their LoRA applied to the routed tokens: what transformers' ``grouped_mm`` experts
    compute on PEFT's folded weights W_e + s B_e A_e, without building them.

    Args:
        module: the experts module, or the outermost PEFT ``ParamWrapper`` around it (its LoRA factors are
            read at call time, so FSDP2's unsharded parameters are the ones used).
        hidden: (T, H) tokens. top_k_index: (T, K) expert ids in [0, module.num_experts). top_k_weights: (T, K).

    Returns:
        (T, H) in the dtype of `hidden`: sum over k of weight[t, k] * expert[top_k_index[t, k]](hidden[t]), each
        expert down(act(gate) * up) (or down(act(up))), every projection plus its LoRA term.
    """
    wrappers, experts = _experts_chain(module)
    num_tokens, top_k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, k) pairs grouped by expert
    counts = torch.zeros(experts.num_experts, dtype=flat.dtype, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)  # no host sync (bincount on CUDA would wait for its max)
    x = hidden[order // top_k]
    if experts.has_gate:
        h = experts._apply_gate(_expert_projection(experts, wrappers, "gate_up_proj", x, offs))
    else:
        h = experts.act_fn(_expert_projection(experts, wrappers, "up_proj", x, offs))
    y = _expert_projection(experts, wrappers, "down_proj", h, offs) * top_k_weights.reshape(-1)[order, None]
    unsorted = torch.empty_like(order)
    unsorted[order] = torch.arange(len(order), device=order.device)
    return y[unsorted].view(num_tokens, top_k, y.shape[-1]).sum(1).to(hidden.dtype)  # -1 is ambiguous for 0 tokens


def use_routed_lora(model: torch.nn.Module) -> int:
    """Run every MoE block's experts with `routed_experts_forward` (set as the ``forward`` of its ``experts``
    module, the outermost PEFT wrapper) instead of PEFT's forward. Parameters, their names and the adapter's
    saved format stay PEFT's. Call after LoRA is added and before `split_experts`.

    Returns:
        The number of experts modules switched.

    Raises:
        ValueError: the experts are already split, or `routed_lora_unsupported` gives a reason.
    """
    blocks = moe_blocks(model)
    for name, block in blocks:
        _, experts = _experts_chain(block.experts)
        if hasattr(experts, "checkpoint_offset"):
            raise ValueError(f"{name}: use_routed_lora must run before split_experts")
        reason = routed_lora_unsupported(experts)
        if reason:
            raise ValueError(f"{name}: the experts {reason}")
        block.experts.forward = partial(routed_experts_forward, block.experts)
    return len(blocks)


COMPILE_BACKEND = "inductor"  # `compile_parts`' default backend (the CPU tests set aot_eager: inductor's C++ build is slow)
_COMPILED_ROUTED: dict = {}  # backend -> torch.compile(routed_experts_forward), made once: every layer shares its code


def compile_parts(layers, part: str, backend=None) -> int:
    """``torch.compile`` parts of every decoder layer in place (module and parameter names unchanged):

    - ``moe``: each MoE block's router (``gate``, ``Module.compile``) and, where `use_routed_lora` set it, its
      experts' `routed_experts_forward`: routing (sort, offsets, gather, weights, unsort) and the grouped GEMMs,
      base and LoRA, in one graph (the GEMMs are the opaque `grouped_mm` operator). The experts module's own
      ``__call__`` (FSDP2's hooks) and, under EP, the all-to-all of `ep_dispatch` stay eager.
    - ``layers``: each decoder layer whole (``Module.compile``, as torchtitan does), before ``fully_shard``.

    Call after `use_routed_lora` and before `split_experts` (which wraps the experts' forward as it finds it) and
    ``fully_shard``. Every layer runs the same compiled code (parameters are graph inputs, not constants).
    `backend`: torch.compile's, a name or a callable; default `COMPILE_BACKEND` (``aot_eager`` traces forward and
    backward as inductor does, without generating code).

    Returns:
        The number of modules or forwards compiled. Raises ValueError for another `part`.
    """
    if part not in ("moe", "layers"):
        raise ValueError(f"part must be 'moe' or 'layers', got {part!r}")
    backend = backend or COMPILE_BACKEND
    count = 0
    for layer in layers:
        if part == "layers":
            layer.compile(backend=backend)
            count += 1
            continue
        for _, block in moe_blocks(layer):
            block.gate.compile(backend=backend)
            forward = block.experts.forward
            if isinstance(forward, partial) and forward.func is routed_experts_forward:
                if backend not in _COMPILED_ROUTED:
                    _COMPILED_ROUTED[backend] = torch.compile(routed_experts_forward, backend=backend)
                block.experts.forward = partial(_COMPILED_ROUTED[backend], *forward.args)
                count += 1
            count += 1
    return count


# ----------------------------------------------------------------------------- activation checkpointing
def _checkpointed(forward, *args, **kwargs):
    """`forward` under non-reentrant activation checkpointing when autograd records (training), else plainly.
    Early stop is off so that a recompute runs every collective of the forward (EP all-to-all) on every rank."""
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    with set_checkpoint_early_stop(False):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def checkpoint_parts(layers, part: str) -> int:
    """Recompute one part of every decoder layer in backward instead of keeping its activations: ``attention``
    (each module whose class name ends in ``Attention``) or ``experts`` (each MoE block: router and experts,
    with the EP all-to-all). Module names, and so parameter names, do not change (the modules' ``forward`` is
    wrapped in place). ``full`` (whole layers) is transformers' ``gradient_checkpointing_enable``.

    Returns:
        The number of modules wrapped. Raises ValueError for another `part`.
    """
    if part not in ("attention", "experts"):
        raise ValueError(f"part must be 'attention' or 'experts', got {part!r}")
    targets = []
    for layer in layers:
        if part == "experts":
            targets += [block for _, block in moe_blocks(layer)]
        else:
            targets += [m for m in layer.modules() if type(m).__name__.endswith("Attention")]
    return checkpoint_modules(targets)


def checkpoint_modules(modules) -> int:
    """Recompute each module of `modules` in backward instead of keeping its activations (non-reentrant
    activation checkpointing, early stop off), by wrapping its ``forward`` in place: names and parameters stay.

    Returns:
        The number of modules wrapped.
    """
    modules = list(modules)
    for module in modules:
        module.forward = partial(_checkpointed, module.forward)
    return len(modules)


# ----------------------------------------------------------------------------- model
def build_base(auto_class, hf_config, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int):
    """The base model, before LoRA and the expert split, in `dtype`.

    ``cfg.pretrained`` and ``cfg.lazy_load``: built on the meta device (buffers real), for
    `cookbook.sft.lazy_load.load_base_lazily` once the experts are split, so that a rank reads only its own;
    pretrained without lazy_load: transformers' ``from_pretrained`` of the whole model on this rank's CPU;
    otherwise random weights from `seed`, generated on `device` (seconds for 30 B parameters on a GPU, where
    the CPU's serial generator takes minutes): the same on every rank, so on a GPU the whole base must fit in
    its memory once (61 GB for a 30 B model in bf16) before the experts are split and the rest sharded.
    Logs (rank 0) how it was made and in how many seconds, and for a model with Mamba layers which
    implementation they run (`mamba_kernels`).
    """
    from accelerate import init_empty_weights

    torch.manual_seed(seed)  # same base (random init) on every rank and every EP degree
    started = time.perf_counter()
    if cfg.pretrained and cfg.lazy_load:
        with init_empty_weights(include_buffers=False):  # parameters on meta; buffers (rotary tables) real
            model, how = auto_class.from_config(hf_config, dtype=dtype), "built on the meta device"
    elif cfg.pretrained:
        model, how = auto_class.from_pretrained(cfg.name_or_path, config=hf_config, dtype=dtype), "loaded whole on the CPU"
    else:
        with torch.device(device):
            model, how = auto_class.from_config(hf_config, dtype=dtype), f"made (random init) on {device}"
    log = cookbook.get_logger()
    log.info(f"base model {how} in {time.perf_counter() - started:.1f} s")
    if (kernels := mamba_kernels(hf_config)) is not None:
        log.info(kernels)
    return model


# The packages whose kernels transformers' modeling code of a model type calls when they import
# (`transformers.integrations.hub_kernels.use_kernel_func_from_hub_with_fallback`), else its PyTorch path.
MAMBA_KERNEL_PACKAGES = {"nemotron_h": ("mamba_ssm", "causal_conv1d")}


def mamba_kernels(hf_config) -> str | None:
    """One line saying which implementation the Mamba-2 layers of `hf_config` run: the ``mamba_ssm`` /
    ``causal_conv1d`` kernels where the package imports, transformers' PyTorch reference path where it does
    not (correct, slower; transformers' own warning about it is below the recipes' log level). None for a model
    type without Mamba layers (`MAMBA_KERNEL_PACKAGES`). A package that is installed but fails to import (a
    CUDA extension built for another torch) counts as missing, as transformers counts it."""
    import importlib

    packages = MAMBA_KERNEL_PACKAGES.get(hf_config.get_text_config().model_type)
    if packages is None:
        return None
    found, missing = [], []
    for name in packages:
        try:
            importlib.import_module(name)
            found.append(name)
        except Exception as exc:  # noqa: BLE001 - ImportError, or a broken extension's OSError / RuntimeError
            missing.append(f"{name} ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
    line = f"Mamba-2 layers ({hf_config.get_text_config().model_type}): "
    line += f"kernels of {', '.join(found)}" if found else ""
    if missing:
        line += ("; " if found else "") + f"not importable: {', '.join(missing)}: transformers runs its PyTorch path " \
                "for those parts (correct, slower)"
    return line


def active_flops(model: torch.nn.Module, hf_config, exclude: torch.nn.Module | None = None) -> ModelFlops:
    """FLOPs per token counting the parameters a token uses: all non-embedding parameters but those of
    `exclude` (a vision tower: it runs per image patch, not per token), except that a routed expert layer
    contributes top-k / E of its experts. Attention FLOPs for the attention layers only; Mamba's scan is not
    counted."""
    experts = moe_blocks(model)
    routed = sum(p.numel() for _, b in experts for p in b.experts.parameters())
    text = hf_config.get_text_config()
    frac = text.num_experts_per_tok / experts[0][1].experts.num_experts if experts else 0.0
    types = getattr(text, "layers_block_type", None) or ["full_attention"] * text.num_hidden_layers
    excluded = count_parameters(exclude) if exclude is not None else 0
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return ModelFlops(int(count_parameters(model) - excluded - routed * (1 - frac)), sum(t == "full_attention" for t in types),
                      text.num_attention_heads * head_dim)


def init_lora(model: torch.nn.Module, seed: int) -> list[torch.nn.Parameter]:
    """(Re-)initialise every LoRA factor with PEFT's own initialisation (A: Kaiming-uniform, B: 0) from `seed`,
    in module order, on CPU, in fp32 (the frozen base weights keep their dtype): the same initial adapter
    whatever the load path (a model built on the meta device gives PEFT meta base weights, and PEFT then leaves
    its factors on meta) and the EP degree.

    Returns:
        The trainable parameters.
    """
    from peft.tuners.lora.layer import LoraLayer

    torch.manual_seed(seed)
    for module in model.modules():
        if isinstance(module, LoraLayer):
            for adapter in module.lora_A:
                for layer in (module.lora_A[adapter], module.lora_B[adapter]):
                    if layer.weight.is_meta:
                        layer.to_empty(device="cpu")
                module.reset_lora_parameters(adapter, init_lora_weights=True)
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:
        p.data = p.data.float()
    return trainable


# ----------------------------------------------------------------------------- step
def frozen_if_unsharded(module: torch.nn.Module, mesh: DeviceMesh) -> set[torch.nn.Parameter] | None:
    """The frozen parameters of `module` when `mesh` has one rank (``fully_shard(..., ignored_params=...)``), else None.

    On a one-rank mesh FSDP2 shards nothing, yet it still copies every parameter into its all-gather buffer at
    each unshard (forward, and backward again with ``reshard_after_forward``). For the experts of an EP rank
    with dp = 1 (EP = world size, or one GPU) those are the frozen base weights, ~95% of a Qwen3-30B-A3B (29.0 of 30.5 B parameters): left
    out of FSDP2 they are used in place (they need no gradient reduction), and only LoRA goes through FSDP2.
    """
    if mesh.size() != 1:
        return None
    return {p for p in module.parameters() if not p.requires_grad} or None


def token_mask(batch: dict[str, torch.Tensor], pad_id: int) -> torch.Tensor | None:
    """(B, L) bool: the tokens of a `cookbook.sft.collate` batch that are not padding, for `RouterStats.take`.
    Right-padded rows: the ``attention_mask``. Packed rows (``position_ids``, no mask): all but each row's
    trailing padding, the last document when it holds only `pad_id` (`cookbook.sft.pack`). None: neither key."""
    if "attention_mask" in batch:
        return batch["attention_mask"].bool()
    if "position_ids" not in batch:
        return None
    document = (batch["position_ids"] == 0).cumsum(1)
    last = document == document[:, -1:]
    padding = last & (~last | (batch["input_ids"] == pad_id)).all(1, keepdim=True)
    return ~padding


class RouterStats:
    """Forward hooks on the routers: the load-balancing loss and the expert loads of each forward.

    Each router's hook keeps its latest output on the router module itself (attribute ``router_record``), not in
    a list: under ``torch.compile`` (`compile_parts`) a hook appending to a shared list makes dynamo guard on the
    list's length, so every layer's call failed its guard and recompiled until dynamo's recompile limit (8) sent
    the remaining layers back to eager (measured on one H200, Qwen3-30B-A3B, ``train.compile=layers``). An
    attribute store has no such guard, and every layer runs the same compiled code.
    """

    ATTR = "router_record"

    def __init__(self, model: torch.nn.Module):
        self.blocks = moe_blocks(model)
        for _, block in self.blocks:
            setattr(block.gate, self.ATTR, None)
            block.gate.register_forward_hook(RouterStats._record)
        self.num_experts = self.blocks[0][1].gate.num_experts if self.blocks else 0
        self.sigmoid = bool(self.blocks) and hasattr(self.blocks[0][1].gate, "e_score_correction_bias")
        self.loads = torch.zeros(len(self.blocks), self.num_experts, dtype=torch.float64)

    @staticmethod
    def _record(module: torch.nn.Module, inputs, out) -> None:
        """Forward hook: keep the router's logits (tokens, experts) and chosen experts (tokens, top_k)."""
        setattr(module, RouterStats.ATTR, (out[0], out[2]))

    def drop(self) -> None:
        """Forget the routers' records without counting them: those of a recomputing backward (activation
        checkpointing repeats each forward) or of evaluation forwards."""
        for _, block in self.blocks:
            setattr(block.gate, self.ATTR, None)

    def take(self, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Mean Switch-Transformer aux loss over this forward's MoE layers (Fedus et al. 2021, "Switch
        Transformers", eq. 4): E * sum_e f_e * P_e, f_e the share of routed slots that chose expert e, P_e the mean
        router probability of e (sigmoid routers normalised per token); adds the loads, then forgets the records.

        Args:
            mask: the tokens to count, (B, L) of the forward's batch (`token_mask`: padding left out); None: all.

        Returns:
            A 0-dim float32 tensor (zero when no router ran since the last `take` / `drop`, or no token is
            counted), differentiable through the router logits. Computed for all layers at once (one set of
            kernels, not one per layer). Raises ValueError when `mask` does not have one entry per routed token.
        """
        records = [getattr(block.gate, self.ATTR) for _, block in self.blocks]
        self.drop()
        kept = [(i, r) for i, r in enumerate(records) if r is not None]
        if not kept:
            return torch.zeros(())
        layers = [i for i, _ in kept]
        logits = torch.stack([r[0] for _, r in kept]).float()  # (layers, tokens, experts)
        idx = torch.stack([r[1] for _, r in kept])  # (layers, tokens, top_k)
        probs = logits.sigmoid() if self.sigmoid else logits.softmax(-1)
        probs = probs / probs.sum(-1, keepdim=True)
        n, e = len(kept), self.num_experts
        if mask is None:
            slots, mean_probs = torch.ones(idx.numel(), dtype=probs.dtype, device=probs.device), probs.mean(1)
        else:
            if mask.numel() != idx.shape[1]:
                raise ValueError(f"mask has {mask.numel()} entries for {idx.shape[1]} routed tokens")
            w = mask.reshape(-1).to(device=probs.device, dtype=probs.dtype)
            slots = w[None, :, None].expand(idx.shape).reshape(-1)  # each (layer, token, k) slot weighs as its token
            mean_probs = (probs * w[:, None]).sum(1) / w.sum().clamp(min=1)
        # counts per (layer, expert) with one scatter_add (not bincount: on CUDA it waits for the host to learn
        # its max); the layer offset l * E makes one flat index space of n * E bins
        flat = (idx.reshape(n, -1) + torch.arange(n, device=idx.device).unsqueeze(1) * e).reshape(-1)
        counts = torch.zeros(n * e, dtype=probs.dtype, device=probs.device).scatter_add_(0, flat, slots).reshape(n, e)
        if self.loads.device != counts.device:  # kept on the device: no copy to the host (a wait) per step
            self.loads = self.loads.to(counts.device)
        self.loads.index_add_(0, torch.tensor(layers, device=counts.device), counts.detach().double())
        losses = e * (counts / counts.sum(-1, keepdim=True).clamp(min=1) * mean_probs).sum(-1)
        return losses.mean()

    def load_metrics(self, ep: int, device: torch.device) -> dict[str, float]:
        """Load balance over the window (all ranks), then reset: ``moe/load_max_over_mean`` (busiest expert / mean,
        mean over layers) and ``moe/ep_rank_load_max_over_mean`` (busiest EP rank / mean). Collective."""
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


def param_groups_by_mesh(params: list[torch.nn.Parameter]) -> list[dict[str, Any]]:
    """`params` as optimizer parameter groups, one per device mesh (plain tensors in a group of their own).

    A foreach or fused optimizer (``torch.optim.AdamW(..., fused=True)``) runs each step as a few kernels over
    all the tensors of a group, and DTensors of different meshes cannot share such a kernel. The experts' LoRA
    is sharded over the dp mesh and the rest over the world mesh, hence the groups; a single-tensor loop
    (``foreach=False``) over the ~600 LoRA tensors of Qwen3-30B-A3B took 276 ms of a 1,020 ms step on one H200.

    Returns:
        ``[{"params": [...]}, ...]`` in first-seen order of the meshes; every parameter in exactly one group.
    """
    groups: dict[Any, list[torch.nn.Parameter]] = {}
    for p in params:
        groups.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    return [{"params": ps} for ps in groups.values()]


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float, device: torch.device) -> torch.Tensor:
    """Total gradient norm over all ranks (a 0-d float64 tensor), then clip to `max_norm` (<= 0: no clipping).
    Parameters live on two meshes (world and dp), which torch's clip_grad_norm_ does not mix; every shard of
    every tensor is on exactly one rank, so the sum of the local squared norms over the world is the total.
    Plain (non-DTensor) gradients count as this rank's share. The local norms and the scaling are foreach
    kernels (one launch over all tensors), as in ``torch.nn.utils.clip_grad_norm_``. Collective."""
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
    sq = torch.zeros((), device=device, dtype=torch.float64)
    if grads:
        sq += torch.stack(torch._foreach_norm(grads, 2.0)).double().pow(2).sum()
    dist.all_reduce(sq)
    norm = sq.sqrt()
    if max_norm > 0 and grads:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0).float()
        torch._foreach_mul_(grads, scale)
    return norm


def evaluate(model: torch.nn.Module, loader, device: torch.device, router: RouterStats) -> dict[str, float]:
    """`cookbook.sft.evaluate` (mean loss per labelled token over the evaluation rows of every rank) on a MoE model:
    the routers' records of the evaluation forwards are dropped uncounted (`RouterStats.drop`), so the loads
    logged for training are those of training. Collective."""
    from cookbook.sft import evaluate as sft_evaluate

    return sft_evaluate(model, loader, device, on_batch=lambda batch: router.drop())


# ----------------------------------------------------------------------------- checkpoint and export
class AdapterState(ModelOptimizerState):
    """DCP `Stateful`: LoRA weights and optimizer state, without the frozen base weights. Expert LoRA tensors hold
    different experts on different EP ranks under one name, so they are stored as ``<name>@ep<rank>``."""

    def __init__(self, model, optimizer, meshes: Meshes):
        super().__init__(model, optimizer, StateDictOptions(ignore_frozen_params=True, strict=False))  # DCP still needs every saved key
        self.local = set(meshes.expert_lora_names)
        self.suffix = f"@ep{meshes.dp_ep['ep'].get_local_rank()}"

    def _rename(self, state: dict[str, Any], fwd: bool) -> dict[str, Any]:
        def key(k):
            return (k + self.suffix if k in self.local else k) if fwd else k.removesuffix(self.suffix)
        out = {"model": {key(k): v for k, v in state["model"].items()}}
        if "optim" in state:
            # Tensors are per EP rank; the parameter groups (hyperparameters, parameter names) are the same on every
            # rank and are stored once, under the plain names (checkpoints from before kept rank 0's suffixes).
            optim = state["optim"]
            out["optim"] = {"state": {key(k): v for k, v in optim["state"].items()},
                            "param_groups": [{**g, "params": [re.sub(r"@ep\d+$", "", k) for k in g["params"]]}
                                             for g in optim["param_groups"]]}
        return out

    def state_dict(self) -> dict[str, Any]:
        return self._rename(super().state_dict(), fwd=True)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(self._rename(state, fwd=False))


def gather_lora(model: torch.nn.Module, meshes: Meshes, grads: bool = False) -> dict[str, torch.Tensor]:
    """The LoRA weights (or their gradients) of the unsharded model, on CPU, keyed by parameter name: dense
    LoRA gathered from FSDP shards, expert LoRA from the EP ranks (lora_A along rows, lora_B along its
    expert-fastest columns). Collective."""
    device = torch.device("cuda", torch.cuda.current_device()) if meshes.world.device_type == "cuda" else torch.device("cpu")
    full = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        t = p.grad if grads else p
        t = (t.full_tensor() if isinstance(t, DTensor) else t).detach()
        if name in meshes.expert_lora_names:  # this EP rank's experts: gather the others' in EP-rank order
            parts = [torch.empty_like(t, device=device) for _ in range(meshes.ep)]
            dist.all_gather(parts, t.to(device).contiguous(), group=meshes.dp_ep["ep"].get_group())
            if ".lora_A." in name:
                t = torch.cat(parts, 0)
            else:
                per = model.get_submodule(name.split(".lora_B.")[0]).num_experts
                t = torch.cat([q.reshape(q.shape[0], -1, per) for q in parts], 2).reshape(t.shape[0], -1)
        full[name] = t.cpu()
    return full


def export_adapter(model: torch.nn.Module, meshes: Meshes, out_dir: Path) -> Path | None:
    """Write the adapter of the unsharded model in PEFT's format (``adapter_config.json``,
    ``adapter_model.safetensors``), published atomically. Collective; returns the folder on rank 0."""
    full = gather_lora(model, meshes)
    result = None
    if dist.get_rank() == 0:
        tmp = out_dir.with_name(f".tmp-{out_dir.name}")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp, state_dict=full)
        publish(tmp, out_dir)
        result = out_dir
    cookbook.barrier()
    return result


def export_merged(auto_class, name_or_path: str, adapter_dir: Path | None, out_dir: Path, processors=()) -> Path | None:
    """Write the base model (`auto_class` from `name_or_path`) with the adapter folded in (``merge_and_unload``), in
    the checkpoint's dtype, with `processors` (tokenizer, image processor) saved beside it: a plain transformers
    model. Rank 0 loads the whole base model on CPU for it (about 2 bytes per parameter in bf16); published
    atomically. Collective; the folder on rank 0."""
    from peft import PeftModel

    result = None
    if dist.get_rank() == 0:
        base = auto_class.from_pretrained(name_or_path, dtype="auto")
        merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
        tmp = out_dir.with_name(f".tmp-{out_dir.name}")
        shutil.rmtree(tmp, ignore_errors=True)
        merged.save_pretrained(tmp)
        for processor in processors:
            processor.save_pretrained(tmp)
        publish(tmp, out_dir)
        result = out_dir
    cookbook.barrier()
    return result
