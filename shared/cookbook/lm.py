"""Model-side helpers of the causal-LM recipes: real-token counts, a sharding-independent random init of FSDP2 models,
attention implementations that cannot train here, activation checkpointing of chosen modules."""

from __future__ import annotations

import hashlib
from functools import partial

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from cookbook.config import ConfigError
from cookbook.sft import IGNORE_INDEX


def count_tokens(batch: dict[str, torch.Tensor], pad_id: int) -> torch.Tensor:
    """Real (non-padding) tokens of a batch (0-d, on its device), by structure, never by token id: the
    ``attention_mask`` sum; for packed rows (``position_ids``) all but a row's final padding document (all `pad_id`,
    no label); otherwise every token."""
    ids = batch["input_ids"]
    if "attention_mask" in batch:
        return batch["attention_mask"].sum()
    if "position_ids" not in batch:
        return torch.tensor(ids.numel(), device=ids.device)
    pos, labels = batch["position_ids"], batch["labels"]
    cols = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    last_start = torch.where(pos == 0, cols, 0).amax(1, keepdim=True)  # (B, 1): where each row's last document starts
    tail = cols >= last_start
    padding = ((ids == pad_id) & (labels == IGNORE_INDEX) | ~tail).all(1)  # the last document is padding
    return ids.numel() - (padding[:, None] & tail).sum()


def _seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") & (2**63 - 1)


@torch.no_grad()
def init_sharded_weights(model: torch.nn.Module, seed: int, device: torch.device) -> None:
    """Randomly initialise a Hugging Face model of DTensor shards so that the full weights are the same for any number
    of ranks and placement: module by module, its parameters made whole on `device`, initialised by the model's
    ``_init_weights`` from a seed of `seed` and the module's name, and each rank's shard copied out."""
    from transformers import PreTrainedModel

    for obj in [*model.modules(), *model.parameters(), *model.buffers()]:
        if hasattr(obj, "_is_hf_initialized"):  # set while building on meta; would make the init skip them
            del obj._is_hf_initialized
    done: set[int] = set()  # tied parameters: initialised once, under the first module's name

    def visit(module: torch.nn.Module, owner: PreTrainedModel, name: str) -> None:
        owner = module if isinstance(module, PreTrainedModel) else owner  # composite models: each part its own rules
        for child_name, child in module.named_children():
            hf_name = name if child_name in ("_checkpoint_wrapped_module", "_orig_mod") else f"{name}.{child_name}"
            visit(child, owner, hf_name)
        params = {n: p for n, p in module._parameters.items() if p is not None and id(p) not in done}
        if not params and not any(b is not None for b in module._buffers.values()):
            return
        full = {n: torch.empty(p.shape, dtype=p.dtype, device=device) for n, p in params.items()}
        original = dict(module._parameters)
        module._parameters.update({n: torch.nn.Parameter(t, requires_grad=False) for n, t in full.items()})
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed(_seed(seed, name.lstrip(".")))
                owner._init_weights(module)
        finally:
            module._parameters.update(original)
        for n, p in params.items():
            if isinstance(p, DTensor):
                p.to_local().copy_(
                    distribute_tensor(full[n], p.device_mesh, p.placements, src_data_rank=None).to_local()
                )
            else:
                p.copy_(full[n])
            done.add(id(p))

    visit(model, model, "")


def check_attention(attn_implementation: str, on_cpu: bool) -> None:
    """Refuse, before any worker starts, an attention implementation that cannot train on this device.
    Raises ConfigError: ``flex_attention`` on CPU (no backward there)."""
    if on_cpu and attn_implementation == "flex_attention":
        raise ConfigError(
            "model.attn_implementation=flex_attention cannot train on CPU (PyTorch's FlexAttention has "
            "no CPU backward): use sdpa (or eager) on CPU; flex_attention needs CUDA GPUs"
        )


def _checkpointed(forward, *args, **kwargs):
    """`forward` under non-reentrant activation checkpointing when autograd records (training), else plainly.
    Early stop is off so that a recompute runs every collective of the forward (EP all-to-all) on every rank."""
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    with set_checkpoint_early_stop(False):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def checkpoint_modules(modules) -> int:
    """Wrap each module's ``forward`` in activation checkpointing (`_checkpointed`), in place; returns how many."""
    modules = list(modules)
    for module in modules:
        module.forward = partial(_checkpointed, module.forward)
    return len(modules)
