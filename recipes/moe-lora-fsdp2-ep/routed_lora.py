"""Expert LoRA on the routed tokens: each projection of the local experts, base and LoRA, as grouped GEMMs over
the tokens sorted by expert, y_e = x_e W_e^T + s (x_e A_e^T) B_e^T (`routed_experts_forward`, switched on by
`use_routed_lora`), instead of PEFT's forward, which folds W_e + s B_e A_e for every expert in every forward.
PEFT's modules, parameter names and adapter format are kept. `grouped_mm` is one ``torch.library`` custom
operator (``torch.ops.cookbook.grouped_mm``) with a grouped-GEMM backward, so ``torch.compile`` keeps it whole.
"""

from __future__ import annotations

import torch

from expert_parallel import _experts_chain, moe_blocks


_GROUPED_MM = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
# Inductor must hand the ops below their inputs with the strides eager mode has (torch.compile of a layer once laid
# lora_B's expert-major copy out with the expert index innermost, which grouped GEMM refuses); the ops also fix an
# unusable layout themselves (`_gemm_layout`).
_EXACT_STRIDES = tuple(t for t in (getattr(torch.Tag, "needs_exact_strides", None),) if t is not None)


def _kernel_ok(x: torch.Tensor, k: int, n: int) -> bool:
    """Whether torch's grouped GEMM kernel takes these operands: CUDA, bf16, a non-empty S and 16-byte aligned
    rows (K and N multiples of 8)."""
    return (
        _GROUPED_MM is not None and x.is_cuda and x.dtype == torch.bfloat16 and len(x) > 0 and k % 8 == 0 and n % 8 == 0
    )


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


def _lora_factors(
    wrappers: list[torch.nn.Module], param: str, dtype: torch.dtype
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(A (E, in, r), s B (E, r, out)) in `dtype` (fp32 LoRA outside FSDP2's mixed precision is cast to it first, as
    FSDP2 would) of each active, unmerged adapter on the expert parameter `param`, from
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
                a, b, r = w.lora_A[name].weight.to(dtype), w.lora_B[name].weight.to(dtype), w.r[name]
                factors.append(
                    (
                        a.reshape(w.num_experts, r, -1).transpose(1, 2),
                        (b.reshape(b.shape[0], r, w.num_experts).permute(2, 1, 0) * w.scaling[name]).contiguous(),
                    )
                )
    return factors


def _expert_projection(experts, wrappers, param: str, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x (S, in) sorted by expert -> (S, out): x_e W_e^T + sum over adapters of (x_e A_e^T)(s B_e)^T, each a grouped
    GEMM in the base weight's dtype."""
    weight = getattr(experts, param)
    y = grouped_mm(x, weight if experts.is_transposed else weight.transpose(1, 2), offs)
    for a, b in _lora_factors(wrappers, param, weight.dtype):
        y = y + grouped_mm(grouped_mm(x, a, offs), b, offs)
    return y


def routed_experts_forward(
    module: torch.nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
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
    counts = torch.zeros(experts.num_experts, dtype=flat.dtype, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
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


_ROUTED_CLASSES: dict[type, type] = {}


def _routed_class(cls: type) -> type:
    """`cls` with `routed_experts_forward` as its ``forward``, one class for all layers: a compiled decoder layer
    guards on the class, where a per-layer function object (a ``partial``) made every layer compile anew until
    dynamo's recompile limit (8) left the rest eager (measured on one H100, 24 layers, no FSDP2)."""
    if cls not in _ROUTED_CLASSES:
        _ROUTED_CLASSES[cls] = type(f"Routed{cls.__name__}", (cls,), {"forward": routed_experts_forward})
    return _ROUTED_CLASSES[cls]


def use_routed_lora(model: torch.nn.Module) -> int:
    """Run every MoE block's experts with `routed_experts_forward` (the ``forward`` of its ``experts`` module, the
    outermost PEFT wrapper, whose class becomes a subclass: `_routed_class`) instead of PEFT's forward. Parameters,
    their names and the adapter's saved format stay PEFT's. Call after LoRA is added and before `split_experts`.

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
        block.experts.__class__ = _routed_class(type(block.experts))
    return len(blocks)
