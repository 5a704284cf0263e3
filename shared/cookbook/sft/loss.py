"""The SFT objective and its evaluation: next-token cross entropy summed over labelled (assistant) tokens."""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Iterable

import torch

from cookbook.dist import all_reduce_sum
from cookbook.sft.data import IGNORE_INDEX


def _shifted_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L - 1, V) fp32 logits and the (B, L - 1) labels they predict (label t from position t - 1)."""
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "cu_seq_lens")}
    if "cu_seq_lens" in batch:  # read by the varlen attention only; L bounds any document's length
        t = batch["input_ids"].shape[1]
        inputs.update(cu_seq_lens_q=batch["cu_seq_lens"], cu_seq_lens_k=batch["cu_seq_lens"], max_length_q=t, max_length_k=t)
    # use_cache=False: with a cache, transformers does not derive document boundaries from position_ids.
    logits = model(**inputs, use_cache=False).logits
    return logits[:, :-1].float(), batch["labels"][:, 1:]


def token_loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Summed next-token cross entropy over the labelled tokens of one batch: the training loss before
    normalisation (divide by the labelled tokens of the global batch, `count_label_tokens`).

    Args:
        model: a causal LM (or a wrapper: DDP, FSDP2, PEFT, DeepSpeed) returning ``logits`` (B, L, V).
        batch: ``input_ids`` and ``labels`` (B, L; `IGNORE_INDEX` where no loss) and the other model inputs
            (``attention_mask`` or ``position_ids``; images for vision-language models), on the model's
            device; its ``cu_seq_lens`` (`collate`) is passed as the varlen attention's
            ``cu_seq_lens_q/k`` with ``max_length_q/k`` = L.

    Returns:
        0-d fp32 tensor, in nats (logits cast to fp32 before the softmax), with the autograd graph.
    """
    logits, labels = _shifted_logits(model, batch)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                                             reduction="sum")


def count_label_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The number of tokens `token_loss_sum` sums over: labels other than `IGNORE_INDEX` at positions 1..L-1
    (0-d int64 tensor on the labels' device)."""
    return (batch["labels"][:, 1:] != IGNORE_INDEX).sum()


def token_loss_sums(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`token_loss_sum` with the counts an evaluation needs, for one batch (see `token_loss_sum` for the args).

    Returns:
        ``loss_sum`` (nats), ``tokens`` (labelled tokens) and ``correct`` (labelled tokens whose label is
        the argmax of the logits): 0-d tensors. ``loss_sum / tokens`` is the mean loss per token.
    """
    logits, labels = _shifted_logits(model, batch)
    mask = labels != IGNORE_INDEX
    loss_sum = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX,
                                                 reduction="sum")
    return {"loss_sum": loss_sum, "tokens": mask.sum(), "correct": ((logits.argmax(-1) == labels) & mask).sum()}


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Iterable[dict[str, torch.Tensor]], device: torch.device, *,
             context: Callable[[], ContextManager] = contextlib.nullcontext,
             on_batch: Callable[[dict[str, torch.Tensor]], None] | None = None,
             accuracy: bool = False) -> dict[str, float]:
    """Mean loss per labelled token over this rank's `batches` and those of every other rank.

    Each rank sums token losses and counts over its own batches (possibly none), then one all-reduce
    (`cookbook.all_reduce_sum`) gives ``sum of losses / labelled tokens`` over the whole evaluation set,
    whatever the number of ranks and the batch sizes. A model sharded with FSDP2 or ZeRO-3 gathers its
    parameters collectively in each forward: then every rank must get the same number of batches
    (`cookbook.sft.shard_for_eval`). A `DistributedDataParallel` model is run through its inner module:
    DDP's forward broadcasts buffers from rank 0, a collective that a rank with fewer batches would not join.

    Args:
        model: the causal LM; put in eval mode for the loop, then back in the mode it was in.
        batches: a DataLoader or any iterable of `collate` batches; their tensors are moved to `device`.
        device: this rank's device (that of its collectives).
        context: called around each forward, e.g. an autocast or the Trainer's loss context.
        on_batch: called with each batch after its forward (e.g. to drop a hook's records).
        accuracy: also return ``mean_token_accuracy`` (share of labelled tokens predicted by the argmax).

    Returns:
        ``loss`` (nats per labelled token; 0 without labelled tokens), ``tokens`` (labelled tokens of all
        ranks) and, with `accuracy`, ``mean_token_accuracy``: Python floats, the same on every rank.
    """
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
