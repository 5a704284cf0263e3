"""Rows of SFT examples: the padding id, train and eval rows (packed or not), and rows collated into batches."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from cookbook.sft.data import SFTStats, load_examples, pack, pad_batch


def pad_token_id(tokenizer) -> int:
    """The tokenizer's pad token id, else its end-of-sequence id (safe: padding is never trained and real tokens
    are counted by mask or position).

    Raises:
        ValueError: the tokenizer has neither.
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
    """One batch of SFT rows for a DataLoader's ``collate_fn``: packed rows stacked as ``input_ids``, ``labels``,
    ``position_ids`` (B, L) int64 without a mask (with `cu_seq_lens`, also the (documents + 1,) int32 offsets for
    the ``varlen`` attention; leave it out for the Trainer); other rows right-padded to a multiple of 8 with an
    ``attention_mask``.

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
