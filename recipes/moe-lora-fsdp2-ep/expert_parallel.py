"""Expert parallelism (EP) on Hugging Face MoE blocks with fused 3-D experts (transformers 5), beside FSDP2.

- `init_meshes`: ``world`` (all ranks: the dense FSDP2 units) and ``dp_ep`` (dp, ep): the experts.
- `split_experts`: each EP rank keeps its experts' base weights and LoRA factors and routes its tokens with
  `ep_dispatch`: (token, expert) pairs travel to the expert's rank and back with ``all_to_all_single``, the
  autograd `AllToAll` (its backward sends the gradients back the same way).
- `frozen_if_unsharded`, `param_groups_by_mesh`, `clip_grad_norm`: FSDP2 and the optimizer over two meshes.
- `AdapterState` (DCP: expert LoRA stored per EP rank), `gather_lora`, `export_adapter` (PEFT format) and
  `export_merged`: checkpoints and exports of the unsharded adapter.
"""

from __future__ import annotations

import re
import shutil
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


def moe_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, block) of every MoE block: a module with a router ``gate`` and fused ``experts``."""
    return [
        (n, m)
        for n, m in model.named_modules()
        if hasattr(m, "gate") and hasattr(getattr(m, "experts", None), "num_experts")
    ]


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
    return Meshes(
        init_device_mesh(device_type, (world_size,), mesh_dim_names=("world",)),
        init_device_mesh(device_type, (world_size // ep, ep), mesh_dim_names=("dp", "ep")),
    )


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits whose backward sends the gradients back the same way."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, recv_sizes: list[int], send_sizes: list[int], group: dist.ProcessGroup
    ) -> torch.Tensor:
        ctx.sizes, ctx.group = (send_sizes, recv_sizes), group
        out = x.new_empty(sum(recv_sizes), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv_sizes, send_sizes, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return AllToAll.apply(grad, *ctx.sizes, ctx.group), None, None, None


def ep_dispatch(
    experts: torch.nn.Module,
    local_forward,
    group: dist.ProcessGroup,
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
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
    if not len(
        local_ids
    ):  # no token here: keep x and the LoRA in the graph, for backward's all-to-all and zero gradients
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
    meta device stay there, with ``checkpoint_offset`` telling `lazy_load` where to read.

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
            setattr(
                experts,
                pname,
                torch.nn.Parameter(p.detach()[first : first + per].clone(), requires_grad=p.requires_grad),
            )
        for w in wrappers:
            for lora in (w.lora_A, w.lora_B):
                for adapter, layer in lora.items():
                    wt = layer.weight.detach()
                    if lora is w.lora_A:
                        wt = wt[first * w.r[adapter] : (first + per) * w.r[adapter]]
                    else:
                        wt = wt.reshape(wt.shape[0], -1, w.num_experts)[:, :, first : first + per].reshape(
                            wt.shape[0], -1
                        )
                    layer.weight = torch.nn.Parameter(wt.clone(), requires_grad=layer.weight.requires_grad)
                    local_names.append(
                        f"{name}.experts.{_wrapper_path(block.experts, w)}{'lora_A' if lora is w.lora_A else 'lora_B'}.{adapter}.weight"
                    )
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


# ----------------------------------------------------------------------------- FSDP2 and the optimizer over two meshes
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


def param_groups_by_mesh(named: list[tuple[str, torch.nn.Parameter]]) -> list[dict[str, Any]]:
    """The parameters of `named` (``model.named_parameters()``) as optimizer parameter groups, one per device mesh;
    plain tensors (a world of one without FSDP2) in the same two groups by name (experts' or not), so that a
    checkpoint of either build resumes in the other.

    A foreach or fused optimizer (``torch.optim.AdamW(..., fused=True)``) runs each step as a few kernels over
    all the tensors of a group, and DTensors of different meshes cannot share such a kernel. The experts' LoRA
    is sharded over the dp mesh and the rest over the world mesh, hence the groups; a single-tensor loop
    (``foreach=False``) over the ~600 LoRA tensors of Qwen3-30B-A3B took 276 ms of a 1,020 ms step on one H200.

    Returns:
        ``[{"params": [...]}, ...]`` in first-seen order of the meshes; every parameter in exactly one group.
    """
    groups: dict[Any, list[torch.nn.Parameter]] = {}
    for name, p in named:
        groups.setdefault(p.device_mesh if isinstance(p, DTensor) else ".experts." in name, []).append(p)
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


# ----------------------------------------------------------------------------- checkpoint and export
class AdapterState(ModelOptimizerState):
    """DCP `Stateful`: LoRA weights and optimizer state, without the frozen base weights. Expert LoRA tensors hold
    different experts on different EP ranks under one name, so they are stored as ``<name>@ep<rank>``."""

    def __init__(self, model, optimizer, meshes: Meshes):
        super().__init__(
            model, optimizer, StateDictOptions(ignore_frozen_params=True, strict=False)
        )  # DCP still needs every saved key
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
            out["optim"] = {
                "state": {key(k): v for k, v in optim["state"].items()},
                "param_groups": [
                    {**g, "params": [re.sub(r"@ep\d+$", "", k) for k in g["params"]]} for g in optim["param_groups"]
                ],
            }
        return out

    def state_dict(self) -> dict[str, Any]:
        return self._rename(super().state_dict(), fwd=True)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(self._rename(state, fwd=False))


def gather_lora(model: torch.nn.Module, meshes: Meshes, grads: bool = False) -> dict[str, torch.Tensor]:
    """The LoRA weights (or their gradients) of the unsharded model, on CPU, keyed by parameter name: dense
    LoRA gathered from FSDP shards, expert LoRA from the EP ranks (lora_A along rows, lora_B along its
    expert-fastest columns). Collective."""
    device = (
        torch.device("cuda", torch.cuda.current_device()) if meshes.world.device_type == "cuda" else torch.device("cpu")
    )
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
