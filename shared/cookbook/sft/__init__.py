"""Supervised fine-tuning of language models, the pieces SFT recipes share: `rows` (rows -> messages), `template`
(token ids and assistant-only labels through the chat template), `stats`, `data` (`prepare`, packing, batches), `loss`,
`attention` (``varlen``), `config` (the ``data`` section, ``--check``), `show` (``--show-examples``): docs/sft-data.md."""

from cookbook.sft.rows import (IGNORE_INDEX, ROLES, EmptyAnswerError, RowList, SFTDataError,  # noqa: F401
                               load_hub_rows, load_rows, row_label, to_conversation, to_messages)
from cookbook.sft.stats import SFTStats  # noqa: F401
from cookbook.sft.template import (check_tools_rendered, check_vocab, template_conversation,  # noqa: F401
                                   tokenize_conversation)
from cookbook.sft.data import (collate, load_examples, pack, pad_batch, pad_token_id, prepare,  # noqa: F401
                               shard_for_eval, training_rows)
from cookbook.sft.loss import (chunked_token_loss_sum, evaluate, linear_cross_entropy_sum,  # noqa: F401
                               token_loss_sum, token_loss_sums)
from cookbook.sft.attention import register_varlen, varlen_attention  # noqa: F401
from cookbook.sft.config import (MAY_CHANGE, DataConfig, check_data, check_data_config,  # noqa: F401
                                 check_one_step, check_positions, load_tokenizer, resolve_paths)
from cookbook.sft.show import show_data, show_examples  # noqa: F401
