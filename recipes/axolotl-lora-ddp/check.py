"""Check an Axolotl config of this recipe before any GPU is used, and build its data set as Axolotl's
``chat_template`` loader sees it (the recipe's ``--check``; launch.sh runs it first). Needs no Axolotl:

    python recipes/axolotl-lora-ddp/check.py recipes/axolotl-lora-ddp/config.yaml
    python recipes/axolotl-lora-ddp/check.py recipes/axolotl-lora-ddp/tiny.yaml --random-init recipes/axolotl-lora-ddp/tiny/olmo3

Checks the keys this recipe relies on (present, of the right type, in range), refuses a key that looks like a
misspelling of one of them (Axolotl 0.19's schema accepts unknown keys silently: ``lora_rr: 8`` trains with the
default rank), then reads every ``datasets`` file and renders each conversation with the tokenizer's chat template,
labels on the assistant turns (``roles_to_train: [assistant]``, ``train_on_eos: turn``), cut at ``sequence_len``.
``--random-init DIR`` saves a randomly initialised model of ``base_model``'s config.json (and the tokenizer) to DIR,
so Axolotl, which loads weights, can run the tiny twin or a benchmark. Paths resolve against the config's folder.
Exit status 2 with one line naming the file and the key on bad input.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

if TYPE_CHECKING:
    from cookbook.sft import SFTStats

# key -> (type, required); the keys the recipe's configs set and the data check reads.
KEYS = {
    "base_model": (str, True),
    "tokenizer_config": (str, False),
    "trust_remote_code": (bool, False),
    "adapter": (str, True),
    "load_in_4bit": (bool, False),
    "load_in_8bit": (bool, False),
    "lora_r": (int, True),
    "lora_alpha": (int, True),
    "lora_dropout": (float, True),
    "lora_target_modules": (list, True),
    "chat_template": (str, False),
    "datasets": (list, True),
    "dataset_prepared_path": (str, False),
    "val_set_size": (float, False),
    "sequence_len": (int, True),
    "excess_length_strategy": (str, False),
    "sample_packing": (bool, False),
    "pad_to_sequence_len": (bool, False),
    "attn_implementation": (str, False),
    "micro_batch_size": (int, True),
    "gradient_accumulation_steps": (int, True),
    "max_steps": (int, True),
    "learning_rate": (float, True),
    "warmup_steps": (int, False),
    "lr_scheduler": (str, False),
    "weight_decay": (float, False),
    "max_grad_norm": (float, False),
    "optimizer": (str, False),
    "seed": (int, False),
    "bf16": (bool, False),
    "gradient_checkpointing": (bool, False),
    "ddp_find_unused_parameters": (bool, False),
    "logging_steps": (int, False),
    "save_strategy": (str, False),
    "output_dir": (str, True),
}
DATASET_KEYS = {
    "path": str,
    "ds_type": str,
    "type": str,
    "field_messages": str,
    "roles_to_train": list,
    "train_on_eos": str,
}


EXCESS = ("drop", "truncate", "raise")  # excess_length_strategy: a row longer than sequence_len (Axolotl: drop)


class ConfigError(ValueError):
    """A bad config: the message names the file and the key."""


def load(path: str | Path) -> dict:
    """The config at `path`, checked (see the module docstring); ``datasets[*].path`` made absolute.

    Raises:
        ConfigError: a missing file, bad YAML, a missing or mistyped key, a likely misspelling, a value out of range.
    """
    p = Path(path)
    if not p.is_file():
        from cookbook.config import config_not_found

        raise ConfigError(config_not_found(p, Path(__file__).resolve().parent))
    try:
        cfg = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{p}: the top level must be a mapping of Axolotl keys")
    for key in cfg:
        if key not in KEYS:
            near = difflib.get_close_matches(key, KEYS, n=1, cutoff=0.8)
            if near:
                raise ConfigError(
                    f"{p}: key '{key}' is not an Axolotl key this recipe uses; did you mean "
                    f"'{near[0]}'? (Axolotl would ignore it silently)"
                )
    for key, (kind, required) in KEYS.items():
        if key not in cfg:
            if required:
                raise ConfigError(f"{p}: key '{key}' is required")
            continue
        value = cfg[key]
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not ok:
            raise ConfigError(f"{p}: key '{key}' must be {kind.__name__}, got {value!r}")
    if cfg["adapter"] not in ("lora", "qlora"):
        raise ConfigError(f"{p}: key 'adapter' must be lora or qlora, got {cfg['adapter']!r}")
    if (cfg["adapter"] == "qlora") != bool(cfg.get("load_in_4bit")):
        raise ConfigError(f"{p}: key 'load_in_4bit' must be true with adapter: qlora, and only then")
    for key in ("lora_r", "lora_alpha", "sequence_len", "micro_batch_size", "gradient_accumulation_steps", "max_steps"):
        if cfg[key] < 1:
            raise ConfigError(f"{p}: key '{key}' must be at least 1, got {cfg[key]}")
    if cfg.get("excess_length_strategy", "drop") not in EXCESS:
        raise ConfigError(
            f"{p}: key 'excess_length_strategy' must be one of {', '.join(EXCESS)}, got "
            f"{cfg['excess_length_strategy']!r}"
        )
    if not cfg["datasets"]:
        raise ConfigError(f"{p}: key 'datasets' is empty")
    for i, ds in enumerate(cfg["datasets"]):
        where = f"{p}: datasets[{i}]"
        if not isinstance(ds, dict) or "path" not in ds:
            raise ConfigError(f"{where}: must be a mapping with a 'path'")
        for key, kind in DATASET_KEYS.items():
            if key in ds and not isinstance(ds[key], kind):
                raise ConfigError(f"{where}.{key} must be {kind.__name__}, got {ds[key]!r}")
        if ds.get("type") != "chat_template":
            raise ConfigError(f"{where}.type must be chat_template (chat rows), got {ds.get('type')!r}")
        ds["path"] = str((p.parent / ds["path"]).resolve()) if not Path(ds["path"]).is_absolute() else ds["path"]
        if not Path(ds["path"]).is_file():
            folder = Path(ds["path"]).is_dir()
            raise ConfigError(
                f"{where}.path: {ds['path']} is a folder, not a file"
                if folder
                else f"{where}.path: file not found: {ds['path']}"
            )
    for key in ("base_model", "tokenizer_config"):
        if key in cfg and (p.parent / cfg[key]).exists():
            cfg[key] = str((p.parent / cfg[key]).resolve())
    return cfg


def build_examples(cfg: dict, tokenizer) -> list[tuple[list[dict], "SFTStats"]]:
    """Per ``cfg["datasets"]`` entry, its conversations as ``{"input_ids", "labels"}`` (lists of ints; -100 where no
    loss): the chat template's rendering, loss on the assistant turns with their end-of-turn tokens; a conversation
    longer than ``sequence_len`` dropped (``excess_length_strategy: drop``, Axolotl's default) or cut (``truncate``);
    and its counts (`cookbook.sft.SFTStats`: rows, kept, cut or dropped, tool calls, reasoning the template rendered
    or left out, keys not used).

    Raises:
        cookbook.sft.SFTDataError: a row that is not a conversation (naming the file and the 1-based row); a row
            longer than ``sequence_len`` with ``excess_length_strategy: raise``.
    """
    from collections import Counter

    from cookbook import sft

    out, cut = [], cfg["sequence_len"]
    strategy = cfg.get("excess_length_strategy", "drop")
    for ds in cfg["datasets"]:
        field = ds.get("field_messages", "messages")
        roles = set(ds.get("roles_to_train", ["assistant"]))
        rows, ignored = sft.load_rows(ds["path"]), Counter()
        st = sft.SFTStats(
            source=ds["path"],
            max_length=cut,
            truncate=strategy == "truncate",
            rows=len(rows),
            lines=rows.lines,
            unrendered_why="the chat template does not render them; Axolotl trains those turns without it",
        )
        examples = []
        for n, row in enumerate(rows, 1):
            chat = {"messages": row[field], **{k: v for k, v in row.items() if k != field}} if field in row else row
            messages, tools = sft.template_conversation(chat, st.label(n), ds["path"], None, st, ignored)
            ids = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False)
            labels, reasoning, unrendered = [-100] * len(ids), [], []  # the starts of turns with reasoning
            for i, m in enumerate(messages):
                if m["role"] not in roles:
                    continue
                start = len(
                    tokenizer.apply_chat_template(
                        messages[:i], tools=tools, tokenize=True, add_generation_prompt=True, return_dict=False
                    )
                )
                end = len(
                    tokenizer.apply_chat_template(messages[: i + 1], tools=tools, tokenize=True, return_dict=False)
                )
                turn = ids[start:end]  # the answer and its end-of-turn token, not what the template adds after it
                if tokenizer.eos_token_id in turn:
                    end = start + len(turn) - turn[::-1].index(tokenizer.eos_token_id)
                labels[start:end] = ids[start:end]
                thought = (m.get("reasoning_content") or "").strip()
                if thought:
                    (reasoning if thought in tokenizer.decode(ids[start:end]) else unrendered).append(start)
            if len(ids) > cut and strategy == "raise":
                raise sft.SFTDataError(
                    f"{ds['path']} {st.label(n)}: {len(ids)} tokens, longer than sequence_len={cut} "
                    f"(excess_length_strategy: raise)"
                )
            calls = sum(len(m.get("tool_calls") or ()) for m in messages)
            example = st.add(n, ids, labels, [(0, calls)], reasoning, unrendered)  # counts what training keeps
            if example is not None:
                examples.append(example)
        st.ignored = dict(ignored)
        out.append((examples, st))
    return out


def build_dataset(cfg: dict, tokenizer) -> list[dict]:
    """The kept conversations of every ``cfg["datasets"]`` entry, in order (`build_examples`)."""
    return [e for examples, _ in build_examples(cfg, tokenizer) for e in examples]


def show_examples(cfg: dict, tokenizer, n: int) -> str:
    """``--show-examples N``: each data file's first `n` conversations as Axolotl trains them, labelled tokens
    between ``[[`` and ``]]``, and the counts per field (`cookbook.sft.show_examples`); before the ``val_set_size``
    split, which Axolotl draws after tokenizing."""
    from cookbook import sft

    text = sft.show_examples(build_examples(cfg, tokenizer), tokenizer, n)
    if cfg.get("val_set_size"):
        text += (
            f"\nval_set_size={cfg['val_set_size']:g}: Axolotl holds out that share of these examples for "
            f"evaluation (seed {cfg.get('seed', 42)}); the rows above are before that split"
        )
    return text


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--random-init", metavar="DIR", help="save a random-init model of base_model's config here")
    ap.add_argument(
        "--show-examples",
        type=int,
        default=0,
        metavar="N",
        help="print N rendered conversations per data file (labels between [[ ]]) and the counts, then exit",
    )
    a = ap.parse_args(argv)
    from cookbook.sft import SFTDataError

    try:
        cfg = load(a.config)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.get("tokenizer_config", cfg["base_model"]))
        if a.show_examples:
            print(show_examples(cfg, tokenizer, a.show_examples))
            return 0
        parts = build_examples(cfg, tokenizer)
    except (ConfigError, SFTDataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from cookbook.sft import SFTStats

    stats = SFTStats.merge([st for _, st in parts])
    print(f"data: {stats.summary()}")
    print(
        f"{a.config}: ok: {cfg['adapter']} r={cfg['lora_r']} alpha={cfg['lora_alpha']}, {stats.examples} "
        f"conversations, {stats.tokens} tokens ({stats.loss_tokens} with loss) at sequence_len {cfg['sequence_len']}"
    )
    if a.random_init:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(cfg.get("seed", 42))
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg["base_model"]), dtype=torch.bfloat16)
        model.save_pretrained(a.random_init)
        tokenizer.save_pretrained(a.random_init)
        print(f"random-init model saved to {a.random_init}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
