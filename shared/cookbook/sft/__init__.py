"""Supervised fine-tuning of language models, the pieces SFT recipes share: `rows` (rows -> messages), `template`
(token ids and assistant-only labels through the chat template), `stats`, `data` (`prepare`, packing, batches,
``--show-examples``), `loss`, `attention` (``varlen``), `config` (the ``data`` section, ``--check``): docs/sft-data.md."""

# ruff: noqa: F401  (the package's public names)

from cookbook.sft.rows import IGNORE_INDEX, ROLES, EmptyAnswerError, RowList, SFTDataError, load_hub_rows, load_rows
from cookbook.sft.rows import row_label, to_conversation, to_messages
from cookbook.sft.stats import SFTStats
from cookbook.sft.template import check_tools_rendered, check_vocab, template_conversation, tokenize_conversation
from cookbook.sft.data import collate, load_examples, pack, pad_batch, pad_token_id, prepare, shard_for_eval
from cookbook.sft.data import show_data, show_examples, training_rows
from cookbook.sft.loss import chunked_token_loss_sum, evaluate, linear_cross_entropy_sum, token_loss_sum
from cookbook.sft.loss import token_loss_sums
from cookbook.sft.attention import register_varlen, varlen_attention
from cookbook.sft.config import MAY_CHANGE, DataConfig, check_data, check_data_config, check_one_step
from cookbook.sft.config import check_positions, load_tokenizer, resolve_paths
