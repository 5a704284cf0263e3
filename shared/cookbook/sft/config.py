"""The ``data`` section of the SFT recipes' configs, and its checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cookbook.config import ConfigError, check_fields
from cookbook.hub import resolve_path


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
    max_dropped_fraction: float = 0.1  # refuse when more of a file's rows are dropped (cut before the answer, empty answer)
    split_turns: bool = False  # one example per assistant turn (templates that rewrite earlier turns: Qwen3)
    reasoning: str = "train"  # an assistant turn's reasoning: train (in the loss), context (rendered, no loss), drop


# Data settings that may differ between a checkpoint and the run that resumes it ("key=value": a key that a
# checkpoint written before it existed lacks, equal when the resuming run has it at that value, its default).
MAY_CHANGE = ("data.num_workers", "data.max_dropped_fraction", "data.reasoning=train")
REASONING = ("train", "context", "drop")


def check_data_config(cfg: Any) -> None:
    """Check a config's ``data`` section (a `DataConfig` or a subclass).

    Raises:
        ConfigError: ``data.max_length`` < 1, ``data.eval_fraction`` outside [0, 1), ``data.max_dropped_fraction``
            outside [0, 1], ``data.reasoning`` not train / context / drop, or ``data.eval_files`` without
            ``data.train_files``.
    """
    check_fields(cfg, at_least={"data.max_length": 1}, one_of={"data.reasoning": REASONING},
                 within={"data.eval_fraction": "[0, 1)", "data.max_dropped_fraction": "[0, 1]"},
                 notes={"data.eval_fraction": "0: no evaluation"})
    if cfg.data.eval_files and not cfg.data.train_files:
        raise ConfigError("data.eval_files is set but data.train_files is empty")


def resolve_paths(cfg: Any, config_dir: str | Path) -> None:
    """Resolve a language-model recipe's paths against its config file's folder, in place: ``model.name_or_path``,
    ``model.tokenizer`` (default: the model's folder or hub id), ``data.train_files`` and ``data.eval_files``.
    A value that is no existing path there (a hub id) is kept (`cookbook.hub.resolve_path`)."""
    cfg.model.name_or_path = resolve_path(cfg.model.name_or_path, config_dir)
    cfg.model.tokenizer = resolve_path(cfg.model.tokenizer or cfg.model.name_or_path, config_dir)
    cfg.data.train_files = [resolve_path(f, config_dir) for f in cfg.data.train_files]
    cfg.data.eval_files = [resolve_path(f, config_dir) for f in cfg.data.eval_files]
