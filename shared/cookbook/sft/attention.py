"""The ``varlen`` attention back-end for transformers: packed documents through PyTorch's variable-length FlashAttention
kernel, no T x T mask. `register_varlen` before building the model, then ``attn_implementation="varlen"``."""

from __future__ import annotations

import functools
import inspect

import torch


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal attention, each packed document to itself (``varlen_attn``, CUDA, bf16/fp16). `query` (batch, heads,
    T, d), `key` / `value` (batch, kv_heads, T, d); `cu_seq_lens_q` (documents + 1,) int32 offsets (None: a row a document).
    Returns ``(output, None)``, output (batch, T, heads, d). Raises ValueError with attention dropout on."""
    from torch.nn.attention.varlen import varlen_attn

    if dropout and module.training:
        raise ValueError("varlen does not implement attention dropout; set the model's attention_dropout to 0")
    b, h, t, d = query.shape
    if cu_seq_lens_q is None:
        cu_seq_lens_q = torch.arange(0, (b + 1) * t, t, device=query.device, dtype=torch.int32)
    q, k, v = (x.transpose(1, 2).reshape(b * t, x.shape[1], d) for x in (query, key, value))
    params = _varlen_params()
    extra = {}
    if "enable_gqa" in params:
        extra["enable_gqa"] = k.shape[1] != h
    elif k.shape[1] != h:  # older torch: repeat the key/value heads
        k, v = (x.repeat_interleave(h // x.shape[1], dim=1) for x in (k, v))
    if "window_size" in params:
        extra["window_size"] = (-1, 0)  # causal
    else:
        extra["is_causal"] = True
    out = varlen_attn(q, k, v, cu_seq_lens_q, cu_seq_lens_q, t, t, scale=scaling, **extra)
    return out.view(b, t, h, d), None


@functools.cache
def _varlen_params() -> frozenset[str]:
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def register_varlen() -> None:
    """Register `varlen_attention` as ``attn_implementation="varlen"`` (the mask interface gives None). Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register("varlen", varlen_attention)
    AttentionMaskInterface.register("varlen", lambda *args, **kwargs: None)  # the documents come as cu_seq_lens
