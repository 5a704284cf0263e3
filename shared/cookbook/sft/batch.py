"""Rows of SFT examples: the padding id, train and eval rows (packed or not), and rows collated into batches."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from cookbook.sft.data import SFTStats, load_examples, pack, pad_batch


def pad_token_id(tokenizer) -> int:
    """The id that pads rows: the tokenizer's pad token, else its end-of-sequence token (Llama 3 Instruct
    has no pad token). Padding is never trained (its labels are -100) and `cookbook.lm.count_tokens`
    counts real tokens by mask or position, not by this id, so sharing it with a real token is safe.

    Raises:
        ValueError: the tokenizer has neither a pad nor an end-of-sequence token.
    """
    for pad_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if pad_id is not None:
            return pad_id
    raise ValueError("the tokenizer has neither a pad token nor an end-of-sequence token: set tokenizer.pad_token")


def training_rows(cfg: Any, tokenizer, seed: int) -> tuple[list[dict], list[dict], SFTStats]:
    """Train and eval rows, and the train statistics (`SFTStats`): `load_examples`, then, when ``cfg.packing``,
    each list packed into rows of ``cfg.max_length`` tokens (`pack`, padded with `pad_token_id`).

    Raises:
        SFTDataError: see `load_examples`.
    """
    train, evals, stats = load_examples(cfg, tokenizer, seed)
    if cfg.packing:
        pad_id = pad_token_id(tokenizer)
        train, evals = pack(train, cfg.max_length, pad_id), pack(evals, cfg.max_length, pad_id)
    return train, evals, stats


def collate(rows: Sequence[dict], pad_id: int, cu_seq_lens: bool = True) -> dict[str, torch.Tensor]:
    """One batch of SFT rows, for a DataLoader's ``collate_fn`` (``partial(collate, pad_id=...)``).

    Packed rows (`cookbook.sft.pack`: all of one length L, with ``position_ids``) are stacked:
    ``input_ids``, ``labels``, ``position_ids`` of shape (B, L), int64, without an attention mask
    (transformers then keeps each document to itself from the position ids). With `cu_seq_lens`, the
    batch also has ``cu_seq_lens``: the (documents + 1,) int32 offsets of the documents in the flattened
    (B * L) tokens, which `token_loss_sum` hands to the model for the ``varlen`` attention
    (`cookbook.sft.attention`); leave it out for a caller that passes the whole batch to the model as
    keyword arguments (Hugging Face Trainer), which would not know the key.

    Other rows are right-padded (`cookbook.sft.pad_batch`, length rounded up to a multiple of 8):
    ``input_ids``, ``attention_mask``, ``labels`` (B, L).

    Raises:
        ValueError: `rows` is empty.
    """
    if not rows:
        raise ValueError("collate: no rows")
    if "position_ids" not in rows[0]:
        return pad_batch(rows, pad_id, pad_to_multiple_of=8)
    batch = {k: torch.tensor([r[k] for r in rows], dtype=torch.long) for k in ("input_ids", "labels", "position_ids")}
    if cu_seq_lens:
        flat = batch["position_ids"].flatten()
        starts = torch.nonzero(flat == 0).flatten()
        batch["cu_seq_lens"] = torch.cat([starts, torch.tensor([flat.numel()])]).to(torch.int32)
    return batch
