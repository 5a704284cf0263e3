"""What an SFT recipe's ``--check`` verifies in one process before any worker starts: the tokenizer against
the model, and enough data for one optimizer step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cookbook.config import ConfigError
from cookbook.sft.batch import pad_token_id
from cookbook.sft.data import check_vocab, load_examples, pack


def check_positions(max_length: int, hf_config, model: str, key: str = "data.max_length") -> None:
    """Refuse `max_length` (tokens per row) beyond the model's ``max_position_embeddings`` (its text config's):
    positions past it were never trained (and learned position embeddings have no row for them).

    Raises:
        ConfigError: "data.max_length=8192 is beyond the max_position_embeddings=512 of <model> ...".
    """
    limit = getattr(hf_config.get_text_config(), "max_position_embeddings", None)
    if isinstance(limit, int) and max_length > limit:
        raise ConfigError(f"{key}={max_length} is beyond the max_position_embeddings={limit} of {model}: the model "
                          f"has no trained positions past {limit}; set {key} to {limit} or less")


def load_tokenizer(tokenizer: str, model: str, max_length: int | None = None):
    """The tokenizer at `tokenizer`, checked against the vocab_size of the model's ``config.json`` at `model`
    (folders or hub ids).

    Raises:
        ConfigError: a local path that does not exist or cannot be loaded; `max_length` beyond the model's positions.
        SFTDataError: more tokens than the model's embedding rows.
    """
    from transformers import AutoConfig, AutoTokenizer

    try:
        loaded = AutoTokenizer.from_pretrained(tokenizer)
        hf_config = AutoConfig.from_pretrained(model)
        vocab_size = hf_config.get_text_config().vocab_size
    except OSError as exc:
        for key, value in (("model.name_or_path", model), ("model.tokenizer", tokenizer)):
            if value.startswith(("/", "./", "../", "~")) and not Path(value).expanduser().exists():
                raise ConfigError(f"{key}: folder not found: {value}") from None
        raise ConfigError(f"model.name_or_path / model.tokenizer: cannot load {model!r}: "
                          f"{str(exc).splitlines()[0]}") from None
    check_vocab(loaded, vocab_size)
    if max_length is not None:
        check_positions(max_length, hf_config, model)
    return loaded


def check_one_step(n_rows: int, micro_batch_size: int, grad_accum_steps: int, world_size: int, note: str = "") -> None:
    """Refuse a data set with fewer rows than one optimizer step takes (micro_batch_size x grad_accum_steps
    x world_size rows: the train loaders drop the last incomplete batch).

    Raises:
        ConfigError: "<n_rows> training rows<note> are too few for one step of <m> x <g> x <w> rows".
    """
    if n_rows < micro_batch_size * grad_accum_steps * world_size:
        raise ConfigError(f"{n_rows} training rows{note} are too few for one step of {micro_batch_size} x "
                          f"{grad_accum_steps} x {world_size} rows")


def check_data(cfg: Any, tokenizer, seed: int, micro_batch_size: int, grad_accum_steps: int, world_size: int) -> str:
    """The data part of a ``--check``: local files read and tokenized, packed with ``cfg.packing``, enough for one
    step; prints ``data: <statistics>`` and returns the "config OK" note (a hub data set is read by workers only).

    Raises:
        ConfigError, SFTDataError: too few rows; a bad file or row.
    """
    if not cfg.train_files:
        return f"data from {cfg.hub_id}"
    train, evals, stats = load_examples(cfg, tokenizer, seed)
    n_rows = len(pack(train, cfg.max_length, pad_token_id(tokenizer))) if cfg.packing else len(train)
    check_one_step(n_rows, micro_batch_size, grad_accum_steps, world_size,
                   note=f" (after holding out {len(evals)} examples for evaluation)")
    print(f"data: {stats.summary()}")
    return f"{len(train)} train / {len(evals)} eval examples"

