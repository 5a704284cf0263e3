"""Supervised fine-tuning of language models: the pieces every SFT recipe shares.

- `cookbook.sft.data`: chat / Alpaca / ShareGPT / completion rows, tokenization with the chat template
  (loss on assistant tokens only), per-file statistics, packing and padding.

The names of `cookbook.sft.data` are importable from `cookbook.sft` directly.
"""

from cookbook.sft.data import (
    IGNORE_INDEX,
    ROLES,
    SFTDataError,
    load_rows,
    load_hub_rows,
    EmptyAnswerError,
    to_conversation,
    to_messages,
    tokenize_conversation,
    check_vocab,
    SFTStats,
    prepare,
    pack,
    pad_batch,
    load_examples,
    shard_for_eval,
)

__all__ = [
    "IGNORE_INDEX",
    "ROLES",
    "SFTDataError",
    "load_rows",
    "load_hub_rows",
    "EmptyAnswerError",
    "to_conversation",
    "to_messages",
    "tokenize_conversation",
    "check_vocab",
    "SFTStats",
    "prepare",
    "pack",
    "pad_batch",
    "load_examples",
    "shard_for_eval",
]
