"""The SFT objective and its evaluation: next-token cross entropy summed over labelled (assistant) tokens. ``full``
upcasts the (B, L, V) logits to fp32 (14 GiB in the backward for 8,192 tokens of Qwen3's 151,936); ``chunked``
(`linear_cross_entropy_sum`) computes logits, loss and gradients a chunk of labelled tokens at a time."""

from __future__ import annotations

import contextlib
import inspect
from typing import Callable, ContextManager, Iterable

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from cookbook.dist import all_reduce_sum
from cookbook.sft.rows import IGNORE_INDEX


def _model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's keyword arguments for `batch` (all but the labels; ``cu_seq_lens`` as the varlen attention's)."""
    # use_cache=False: with a cache, transformers does not derive document boundaries from position_ids.
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "cu_seq_lens")} | {"use_cache": False}
    if "cu_seq_lens" in batch:  # read by the varlen attention only; L bounds any document's length
        t = batch["input_ids"].shape[1]
        inputs.update(
            cu_seq_lens_q=batch["cu_seq_lens"], cu_seq_lens_k=batch["cu_seq_lens"], max_length_q=t, max_length_k=t
        )
    return inputs


def _shifted_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L - 1, V) fp32 logits and the (B, L - 1) labels they predict (label t from position t - 1)."""
    logits = model(**_model_inputs(batch)).logits
    return logits[:, :-1].float(), batch["labels"][:, 1:]


def _cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def token_loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor], chunk_size: int = 0) -> torch.Tensor:
    """Summed next-token cross entropy over the labelled tokens of `batch` (0-d fp32, nats, with the graph) of a causal
    LM (or its DDP, FSDP2, PEFT, DeepSpeed wrapper). `chunk_size` 0 (``train.loss=full``): the logits upcast to fp32;
    > 0 (``chunked``): `chunked_token_loss_sum`, the same value up to rounding."""
    if chunk_size > 0:
        return chunked_token_loss_sum(model, batch, chunk_size)
    return _cross_entropy_sum(*_shifted_logits(model, batch))


def _causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside DDP, DeepSpeed (``.module``) and PEFT (``get_base_model``) wrappers."""
    while True:
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        elif isinstance(getattr(model, "module", None), torch.nn.Module):
            model = model.module
        else:
            return model


def chunked_token_loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor], chunk_size: int) -> torch.Tensor:
    """`token_loss_sum` without the (B, L, V) logits: `linear_cross_entropy_sum` of the labelled hidden states in a
    forward hook, where FSDP2 still holds the head's gathered weight. Raises ValueError: see the refusal below."""
    lm = _causal_lm(model)
    decoder, head = lm.get_decoder(), lm.get_output_embeddings()
    takes_keep = "logits_to_keep" in inspect.signature(lm.forward).parameters
    if decoder is None or head is None or getattr(head, "bias", None) is not None or not takes_keep:
        raise ValueError(
            f"{type(lm).__name__}: the chunked loss needs a causal LM whose forward takes logits_to_keep "
            f"and with a decoder and a bias-free output projection; use the full loss (train.loss=full)"
        )
    labels = batch["labels"][:, 1:]
    keep = labels != IGNORE_INDEX  # (B, L - 1): positions whose next token carries loss
    hidden = []

    def loss_in_forward(_module, _args, out):
        states = hidden[-1][:, :-1][keep]  # (labelled tokens, H)
        out["loss"] = linear_cross_entropy_sum(
            states, head.weight, labels[keep], chunk_size, softcap=getattr(lm.config, "final_logit_softcapping", None)
        )

    hooks = [
        decoder.register_forward_hook(lambda _module, _args, out: hidden.append(out[0])),
        lm.register_forward_hook(loss_in_forward, prepend=True),
    ]
    try:
        out = model(**_model_inputs(batch), logits_to_keep=torch.empty(0, dtype=torch.long, device=labels.device))
    finally:
        for hook in hooks:
            hook.remove()
    return out["loss"]


def _chunk_loss(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, softcap: float | None, grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Summed cross entropy of one chunk (0-d fp32) and, with `grad`, its gradient w.r.t. the (c, V) logits:
    softmax(z) - onehot(label), 0 on ignored rows (times 1 - tanh²(z / cap) with a soft cap)."""
    z = (hidden @ weight.t()).float()  # compute-dtype logits, upcast as the full loss does
    tanh = None
    if softcap:
        tanh = z.div_(softcap).tanh_()
        z = tanh * softcap
    lse = torch.logsumexp(z, dim=1)
    valid = labels != IGNORE_INDEX
    target = torch.where(valid, labels, 0)
    loss = torch.where(valid, lse - z.gather(1, target[:, None])[:, 0], 0.0).sum()
    if not grad:
        return loss, None
    g = z.sub_(lse[:, None]).exp_()  # softmax
    g.scatter_add_(1, target[:, None], -valid[:, None].to(g.dtype))
    g.mul_(valid[:, None])
    if tanh is not None:
        g.mul_(tanh.square_().neg_().add_(1))
    return loss, g.to(hidden.dtype)


def _chunked(hidden, weight, labels, chunk_size, softcap, grad_h=None, grad_w=None) -> torch.Tensor:
    """The summed loss over chunks of `chunk_size` rows, writing the gradients into `grad_h` / `grad_w` if given."""
    total, grad = torch.zeros((), dtype=torch.float32, device=hidden.device), grad_h is not None or grad_w is not None
    for start in range(0, hidden.shape[0], chunk_size):
        h = hidden[start : start + chunk_size]
        loss, g = _chunk_loss(h, weight, labels[start : start + chunk_size], softcap, grad)
        total += loss
        if grad_h is not None:
            torch.mm(g, weight, out=grad_h[start : start + chunk_size])
        if grad_w is not None:
            grad_w.addmm_(g.t(), h)
    return total


class _LinearCrossEntropy(torch.autograd.Function):
    """Loss and gradients in one pass, chunk by chunk (Liger Kernel's fused linear cross entropy, arXiv:2410.10989)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size, softcap):
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        total = _chunked(hidden, weight, labels, chunk_size, softcap, grad_h, grad_w)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.used = False
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_total):
        if ctx.used:
            raise RuntimeError("linear_cross_entropy_sum: a second backward through the same loss is not supported")
        ctx.used = True
        grad_h, grad_w = ctx.saved_tensors
        for g in (grad_h, grad_w):
            if g is not None:
                g.mul_(grad_total)  # in place: the saved gradients are used once
        return grad_h, grad_w, None, None, None


def linear_cross_entropy_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int = 4096,
    *,
    softcap: float | None = None,
) -> torch.Tensor:
    """``cross_entropy((hidden @ weight.T).float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")`` without the
    (N, V) logits, `chunk_size` rows at a time. `hidden` (N, H); `weight` (V, H) a plain tensor; `labels` (N,);
    `softcap`: Gemma 2's ``cap * tanh(logits / cap)``. Memory: about 8 x chunk_size x V bytes instead of 12 x N x V.
    Raises ValueError: shapes that do not match, ``chunk_size < 1``, a weight that is a DTensor shard or empty."""
    from torch.distributed.tensor import DTensor

    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1] or labels.shape != hidden.shape[:1]:
        raise ValueError(
            f"linear_cross_entropy_sum: hidden (N, H), weight (V, H) and labels (N,) expected, got "
            f"{tuple(hidden.shape)}, {tuple(weight.shape)} and {tuple(labels.shape)}"
        )
    if chunk_size < 1:
        raise ValueError(f"linear_cross_entropy_sum: chunk_size must be >= 1, got {chunk_size}")
    if isinstance(weight, DTensor) or weight.numel() == 0:
        raise ValueError(
            "linear_cross_entropy_sum: the output projection's weight is not gathered (a DTensor shard or "
            "an empty ZeRO-3 partition); call it where the model's forward leaves the weight whole (FSDP2: "
            "after the root module's forward), or use the full loss"
        )
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(hidden, weight, labels, chunk_size, softcap)
    with torch.no_grad():
        return _chunked(hidden, weight, labels, chunk_size, softcap)


def token_loss_sums(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`token_loss_sum` with an evaluation's counts: ``loss_sum``, ``tokens`` (labelled), ``correct`` (argmax), 0-d."""
    logits, labels = _shifted_logits(model, batch)
    mask = labels != IGNORE_INDEX
    correct = ((logits.argmax(-1) == labels) & mask).sum()
    return {"loss_sum": _cross_entropy_sum(logits, labels), "tokens": mask.sum(), "correct": correct}


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    batches: Iterable[dict[str, torch.Tensor]],
    device: torch.device,
    *,
    context: Callable[[], ContextManager] = contextlib.nullcontext,
    on_batch: Callable[[dict[str, torch.Tensor]], None] | None = None,
    accuracy: bool = False,
) -> dict[str, float]:
    """Mean loss per labelled token over every rank's `batches` (one all-reduce): ``loss`` (nats), ``tokens`` and, with
    `accuracy`, ``mean_token_accuracy``; floats, the same on every rank. Every rank needs as many batches
    (`shard_for_eval`); `context` wraps each forward (an autocast), `on_batch` is called after each."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    was_training = model.training
    model.eval()
    sums = {k: torch.zeros((), device=device, dtype=torch.float64) for k in ("loss_sum", "tokens", "correct")}
    try:
        for batch in batches:
            batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            with context():
                for k, v in token_loss_sums(model, batch).items():
                    sums[k] += v.double()
            if on_batch is not None:
                on_batch(batch)
    finally:
        model.train(was_training)
    totals = all_reduce_sum(sums, device)
    out = {"loss": totals["loss_sum"] / max(totals["tokens"], 1.0), "tokens": totals["tokens"]}
    if accuracy:
        out["mean_token_accuracy"] = totals["correct"] / max(totals["tokens"], 1.0)
    return out
