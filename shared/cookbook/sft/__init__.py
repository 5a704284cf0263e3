"""Supervised fine-tuning of language models: the pieces every SFT recipe shares.

- `cookbook.sft.data`: `prepare` (rows -> labelled examples), packing and padding; it re-exports
  `cookbook.sft.rows` (chat / Alpaca / ShareGPT rows), `cookbook.sft.template` (tokenization with the chat
  template, loss on assistant tokens only) and `cookbook.sft.stats` (per-file statistics).
- `cookbook.sft.batch`: the padding id, train and eval rows (packed or not), ``collate`` into batches
  (packed rows carry ``cu_seq_lens`` for the varlen attention).
- `cookbook.sft.loss`: the summed next-token loss over labelled tokens, and ``evaluate`` (mean loss per
  labelled token over every rank).
- `cookbook.sft.attention`: the ``varlen`` attention back-end (``register_varlen``).
- `cookbook.sft.check`: what a recipe's ``--check`` verifies (tokenizer against the model, one step of data).
- `cookbook.sft.show`: what ``--show-examples N`` prints (rendered rows, labelled spans marked, counts per field).

Their public names are importable from `cookbook.sft` directly.
"""

from cookbook.sft.data import (
    IGNORE_INDEX,
    ROLES,
    SFTDataError,
    RowList,
    row_label,
    load_rows,
    load_hub_rows,
    EmptyAnswerError,
    to_conversation,
    to_messages,
    reasoning_field,
    template_conversation,
    check_tools_rendered,
    tokenize_conversation,
    check_vocab,
    SFTStats,
    prepare,
    pack,
    pad_batch,
    load_examples,
    shard_for_eval,
)
from cookbook.sft.batch import collate, pad_token_id, training_rows
from cookbook.sft.loss import (
    chunked_token_loss_sum,
    count_label_tokens,
    evaluate,
    linear_cross_entropy_sum,
    token_loss_sum,
    token_loss_sums,
)
from cookbook.sft.attention import register_varlen, varlen_attention
from cookbook.sft.check import check_data, check_one_step, check_positions, load_tokenizer

__all__ = [
    "IGNORE_INDEX",
    "ROLES",
    "SFTDataError",
    "RowList",
    "row_label",
    "load_rows",
    "load_hub_rows",
    "EmptyAnswerError",
    "to_conversation",
    "to_messages",
    "reasoning_field",
    "template_conversation",
    "check_tools_rendered",
    "tokenize_conversation",
    "check_vocab",
    "SFTStats",
    "prepare",
    "pack",
    "pad_batch",
    "load_examples",
    "shard_for_eval",
    "collate",
    "pad_token_id",
    "training_rows",
    "chunked_token_loss_sum",
    "count_label_tokens",
    "linear_cross_entropy_sum",
    "evaluate",
    "token_loss_sum",
    "token_loss_sums",
    "register_varlen",
    "varlen_attention",
    "check_data",
    "check_one_step",
    "check_positions",
    "load_tokenizer",
]

from cookbook.sft.config import MAY_CHANGE, DataConfig, check_data_config, resolve_paths  # noqa: E402

__all__ += ["MAY_CHANGE", "DataConfig", "check_data_config", "resolve_paths"]

from cookbook.sft.show import show_data, show_examples  # noqa: E402

__all__ += ["show_data", "show_examples"]

# Submodules used by name (``cookbook.sft.vision.VLDataset``): image + text rows; shard-by-shard safetensors loading.
from cookbook.sft import lazy_load, vision  # noqa: F401
