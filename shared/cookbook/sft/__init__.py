"""Supervised fine-tuning of language models, the pieces SFT recipes share: `rows` (rows -> messages), `template`
(token ids and assistant-only labels through the chat template), `stats`, `data` (`prepare`, packing, batches), `loss`,
`attention` (``varlen``), `config` (the ``data`` section, ``--check``), `show` (``--show-examples``): docs/sft-data.md."""

from cookbook.sft.rows import (
    IGNORE_INDEX,  # noqa: F401
    ROLES,  # noqa: F401
    EmptyAnswerError,  # noqa: F401
    RowList,  # noqa: F401
    SFTDataError,  # noqa: F401
    load_hub_rows,  # noqa: F401
    load_rows,  # noqa: F401
    row_label,  # noqa: F401
    to_conversation,  # noqa: F401
    to_messages,  # noqa: F401
)
from cookbook.sft.stats import SFTStats  # noqa: F401
from cookbook.sft.template import (
    check_tools_rendered,  # noqa: F401
    check_vocab,  # noqa: F401
    template_conversation,  # noqa: F401
    tokenize_conversation,  # noqa: F401
)
from cookbook.sft.data import (
    collate,  # noqa: F401
    load_examples,  # noqa: F401
    pack,  # noqa: F401
    pad_batch,  # noqa: F401
    pad_token_id,  # noqa: F401
    prepare,  # noqa: F401
    shard_for_eval,  # noqa: F401
    training_rows,  # noqa: F401
)
from cookbook.sft.loss import (
    chunked_token_loss_sum,  # noqa: F401
    evaluate,  # noqa: F401
    linear_cross_entropy_sum,  # noqa: F401
    token_loss_sum,  # noqa: F401
    token_loss_sums,  # noqa: F401
)
from cookbook.sft.attention import register_varlen, varlen_attention  # noqa: F401
from cookbook.sft.config import (
    MAY_CHANGE,  # noqa: F401
    DataConfig,  # noqa: F401
    check_data,  # noqa: F401
    check_data_config,  # noqa: F401
    check_one_step,  # noqa: F401
    check_positions,  # noqa: F401
    load_tokenizer,  # noqa: F401
    resolve_paths,  # noqa: F401
)
from cookbook.sft.show import show_data, show_examples  # noqa: F401
