"""The ``data`` section of the SFT recipes' configs, and what their ``--check`` verifies of it in one process."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cookbook.config import ConfigError, check_fields
from cookbook.hub import check_local_model, resolve_path
from cookbook.sft.data import load_examples, pack, pad_token_id
from cookbook.sft.template import check_vocab


@dataclass
class DataConfig:
    """``data``: chat / Alpaca / ShareGPT / completion rows from local files or a hub data set (`load_examples`)."""

    train_files: list[str] = field(default_factory=list)  # JSON / JSONL / parquet / CSV; empty: hub_id
    eval_files: list[str] = field(default_factory=list)  # empty: eval_fraction of each train source
    hub_id: str = "tatsu-lab/alpaca"
    eval_fraction: float = 0.02  # seeded fraction of each train source held out; 0: no evaluation
    max_length: int = 2048  # tokens per packed row / per example when not packing
    packing: bool = True  # pack examples into rows of exactly max_length tokens (position ids separate them)
    num_workers: int = 1  # data loader worker processes per rank
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. {enable_thinking: false} for Qwen3
    max_dropped_fraction: float = 0.1  # refuse when more of a file's rows are dropped (cut before the answer, empty)
    split_turns: bool = False  # one example per assistant turn (templates that rewrite earlier turns: Qwen3)
    reasoning: str = "train"  # an assistant turn's reasoning: train (in the loss), context (rendered, no loss), drop


# Data settings that may differ between a checkpoint and the run that resumes it ("key=value": a key that a
# checkpoint written before it existed lacks, equal when the resuming run has it at that value, its default).
MAY_CHANGE = ("data.num_workers", "data.max_dropped_fraction", "data.reasoning=train")
REASONING = ("train", "context", "drop")


def check_data_config(cfg: Any) -> None:
    """Check a config's ``data`` section. Raises ConfigError: ``data.max_length`` < 1, ``data.eval_fraction`` outside
    [0, 1), ``data.max_dropped_fraction`` outside [0, 1], ``data.reasoning`` unknown, eval files without train files."""
    check_fields(
        cfg,
        at_least={"data.max_length": 1},
        one_of={"data.reasoning": REASONING},
        within={"data.eval_fraction": "[0, 1)", "data.max_dropped_fraction": "[0, 1]"},
        notes={"data.eval_fraction": "0: no evaluation"},
    )
    if cfg.data.eval_files and not cfg.data.train_files:
        raise ConfigError("data.eval_files is set but data.train_files is empty")


def resolve_paths(cfg: Any, config_dir: str | Path) -> None:
    """The model, tokenizer and data paths resolved against the config file's folder, in place (hub ids kept)."""
    cfg.model.name_or_path = resolve_path(cfg.model.name_or_path, config_dir)
    cfg.model.tokenizer = resolve_path(cfg.model.tokenizer or cfg.model.name_or_path, config_dir)
    cfg.data.train_files = [resolve_path(f, config_dir) for f in cfg.data.train_files]
    cfg.data.eval_files = [resolve_path(f, config_dir) for f in cfg.data.eval_files]


def check_positions(max_length: int, hf_config, model: str) -> None:
    """Raise ConfigError if `max_length` is beyond the model's ``max_position_embeddings`` (never trained positions)."""
    limit = getattr(hf_config.get_text_config(), "max_position_embeddings", None)
    if isinstance(limit, int) and max_length > limit:
        raise ConfigError(
            f"data.max_length={max_length} is beyond the max_position_embeddings={limit} of {model}: the model "
            f"has no trained positions past {limit}; set data.max_length to {limit} or less"
        )


def load_tokenizer(tokenizer: str, model: str, max_length: int | None = None):
    """The tokenizer at `tokenizer`, checked against the model's ``config.json`` at `model` (folders or hub ids).
    Raises ConfigError: a missing or unloadable local path; `max_length` beyond the model's positions;
    SFTDataError: more tokens than the model's embedding rows."""
    from transformers import AutoConfig, AutoTokenizer

    check_local_model(model, "model.name_or_path")
    check_local_model(tokenizer, "model.tokenizer", tokenizer=True)
    try:
        loaded = AutoTokenizer.from_pretrained(tokenizer)
        hf_config = AutoConfig.from_pretrained(model)
        vocab_size = hf_config.get_text_config().vocab_size
    except (OSError, ValueError) as exc:  # ValueError: a folder whose tokenizer files transformers cannot read
        raise ConfigError(
            f"model.name_or_path / model.tokenizer: cannot load {model!r}: {str(exc).splitlines()[0]}"
        ) from None
    check_vocab(loaded, vocab_size)
    if max_length is not None:
        check_positions(max_length, hf_config, model)
    loaded.cookbook_max_positions = getattr(hf_config.get_text_config(), "max_position_embeddings", None)
    return loaded


def check_one_step(n_rows: int, micro_batch_size: int, grad_accum_steps: int, world_size: int, note: str = "") -> None:
    """Raise ConfigError if `n_rows` is fewer than one optimizer step takes (the loaders drop the incomplete batch)."""
    if n_rows < micro_batch_size * grad_accum_steps * world_size:
        raise ConfigError(
            f"{n_rows} training rows{note} are too few for one step of {micro_batch_size} x "
            f"{grad_accum_steps} x {world_size} rows"
        )


def check_data(cfg: Any, tokenizer, seed: int, micro_batch_size: int, grad_accum_steps: int, world_size: int) -> str:
    """The data part of a ``--check``: local files read, tokenized (and packed), enough for one step; prints ``data:
    <statistics>`` and returns the "config OK" note. Raises ConfigError, SFTDataError: too few rows; a bad row."""
    if not cfg.train_files:
        return f"data from {cfg.hub_id}"
    train, evals, stats = load_examples(cfg, tokenizer, seed)
    n_rows = len(pack(train, cfg.max_length, pad_token_id(tokenizer))) if cfg.packing else len(train)
    held = f" (after holding out {len(evals)} examples for evaluation)"
    check_one_step(n_rows, micro_batch_size, grad_accum_steps, world_size, note=held)
    print(f"data: {stats.summary()}")
    return f"{len(train)} train / {len(evals)} eval examples"
