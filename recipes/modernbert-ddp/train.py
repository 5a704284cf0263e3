"""Fine-tune ModernBERT for AG News topic classification (World, Sports, Business, Sci/Tech)
with native PyTorch DDP.

Commands (from this folder; NGPU defaults to all visible GPUs, else 2 CPU processes):

    ./launch.sh                                      # ModernBERT-base on AG News (needs the hub)
    CONFIG_FILE=tiny.yaml ./launch.sh                # tiny model and data, offline, < 1 min on CPU
    ./launch.sh data.train_files=[train.csv] data.eval_files=[test.csv] model.name_or_path=/models/ModernBERT-base
    NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 ./launch.sh     # on each node, with its NODE_RANK

``build_model`` (attention guard, compile per layer), ``DDP`` and ``no_sync`` in ``main``'s step, evaluation
reduced across ranks. What it supports (data formats, outputs, resume on another number of GPUs): README.md
beside this file.
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the heavy imports: the start-up phases (startup_phases) count from the launch

import contextlib
import hashlib
import json
import os
import shutil
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", message=".*set_vital.*")

import cookbook  # first: a package built for another torch is one line (cookbook.builds)
import datasets
import psutil
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Subset
from torchdata.stateful_dataloader import StatefulDataLoader

# Only what the check process (--check) needs at module level: transformers' modeling code pulls in 5 of the 10 s
# of imports on an H200 host (python -X importtime, benchmarks/modernbert-ddp.md). A worker imports it here, which
# on GPU nodes is while the launcher's check still runs (cookbook.launch), not after it.
from transformers import AutoConfig, AutoTokenizer, DataCollatorWithPadding
from transformers import logging as hf_logging

if "--check" not in sys.argv:
    import transformers.models.modernbert.modeling_modernbert  # noqa: F401

from cookbook import lm
from cookbook.checkpoint import Checkpointer, CheckpointError, ModelOptimizerState
from cookbook.checkpoint import export_hf
from cookbook import config
from cookbook.config import ConfigError, check_fields, load_config, to_dict
from cookbook.hub import check_local_model, resolve_path
from cookbook.loop import Run
from cookbook.metrics import ModelFlops, count_parameters, launch_time
from cookbook.config import build_optimizer
from cookbook.sampler import ResizableSampler
from cookbook.errors import not_a_file
from cookbook.tabular import DataError, first_csv_row, records, shown, to_int

LABELS = ["World", "Sports", "Business", "Sci/Tech"]
datasets.disable_progress_bars()
hf_logging.disable_progress_bar()


# ----------------------------------------------------------------------------- config
@dataclass
class ModelConfig:
    name_or_path: str = "answerdotai/ModernBERT-base"  # hub id or local folder
    pretrained: bool = True  # False: random init from the folder's config.json (benchmarks, CI)
    tokenizer: str | None = None  # default: name_or_path
    compile: bool = False  # torch.compile the model (in place: checkpoint keys are unchanged)
    compile_scope: str = (
        "layers"  # layers: each encoder layer apart (compile_model); model: one graph of the whole model
    )
    compile_eval: bool = False  # with compile: evaluate with the compiled model too (false: eagerly, see run_eval)
    attn_implementation: str = (
        "sdpa_padsafe"  # "sdpa_padsafe" (see sdpa_padsafe_attention), "sdpa", "eager", "flash_attention_2"
    )


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=list)  # empty: load hub_id
    eval_files: list[str] = field(default_factory=list)  # empty: the hub's test split, or a slice of train
    hub_id: str = "fancyzhx/ag_news"
    eval_fraction: float = 0.05  # held out of train when there is no eval split
    max_length: int = 256  # tokens; longer texts are truncated (the count is reported)
    padding: str = "max_length"  # "max_length" (static shapes) or "longest" (pad per batch)
    num_workers: int = 2  # data-loader worker processes per rank


@dataclass
class DDPConfig:
    """``ddp``: ``DistributedDataParallel``'s speed settings (PyTorch's defaults); a resume may change them."""

    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = False
    static_graph: bool = False

    def kwargs(self) -> dict:
        """``DistributedDataParallel``'s keyword arguments; ConfigError: ``bucket_cap_mb`` not above 0."""
        if not self.bucket_cap_mb > 0:
            raise ConfigError(f"ddp.bucket_cap_mb={self.bucket_cap_mb}: must be above 0 (MiB per gradient bucket)")
        return {
            "bucket_cap_mb": float(self.bucket_cap_mb),
            "gradient_as_bucket_view": bool(self.gradient_as_bucket_view),
            "static_graph": bool(self.static_graph),
        }


@dataclass
class Config(config.RunConfig):
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: config.HFCheckpointConfig = field(default_factory=config.HFCheckpointConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)


# Settings that may differ between a checkpoint and the run that resumes it; any other change is refused.
# not data.num_workers: the loader state each rank checkpoints has one entry per worker
MAY_CHANGE = (*config.MAY_CHANGE, "ddp.*")
RESIZABLE = True  # resumes on another world size (global data position); cookbook.checkpoint.resizable_recipes


def check_config(cfg: Config, config_dir: Path) -> None:
    """Resolve paths against the config file's folder and reject incompatible values."""
    cfg.model.name_or_path = resolve_path(cfg.model.name_or_path, config_dir)
    cfg.model.tokenizer = resolve_path(cfg.model.tokenizer or cfg.model.name_or_path, config_dir)
    cfg.data.train_files = [resolve_path(f, config_dir) for f in cfg.data.train_files]
    cfg.data.eval_files = [resolve_path(f, config_dir) for f in cfg.data.eval_files]
    if cfg.data.eval_files and not cfg.data.train_files:
        raise ConfigError(
            "data.eval_files is set but data.train_files is empty: give both, or neither to use data.hub_id"
        )
    config.check_run(cfg)
    cfg.ddp.kwargs()  # raises on a bad value
    if cfg.ddp.static_graph and cfg.train.grad_accum_steps > 1:
        raise ConfigError(
            f"ddp.static_graph=true with train.grad_accum_steps={cfg.train.grad_accum_steps}: DDP's static-graph "
            "reducer fails under no_sync(), which gradient accumulation uses (PyTorch issue 143580); "
            "use one or the other"
        )
    check_fields(
        cfg,
        at_least={"data.max_length": 1},
        one_of={
            "data.padding": ("max_length", "longest"),
            "train.activation_checkpointing": ("none", "full"),
            "model.compile_scope": ("model", "layers"),
            "model.attn_implementation": ("sdpa_padsafe", "sdpa", "eager", "flash_attention_2", "flex_attention"),
        },
        within={"data.eval_fraction": "(0, 1)"},
    )
    if cfg.model.compile and cfg.data.padding != "max_length":
        raise ConfigError(
            "model.compile=true needs data.padding=max_length (static shapes); with 'longest', "
            "torch.compile's dynamic shapes failed in inductor on torch 2.11"
        )
    local = Path(cfg.model.name_or_path).exists()
    if not cfg.model.pretrained and not local and "/" not in cfg.model.name_or_path:
        raise ConfigError(f"model.name_or_path={cfg.model.name_or_path!r}: not a folder and not a hub id")


# ----------------------------------------------------------------------------- data
AGNEWS_COLUMNS = ["label", "title", "description"]  # the original AG News CSV: class 1-4, no header


def _is_int(value: str) -> bool:
    try:
        return to_int(value) is not None
    except ValueError:
        return False


def _read_file(path: str, field_name: str) -> datasets.Dataset:
    """One local file as a Dataset with columns ``text`` (str) and ``label`` (0-3).

    CSV layouts, told apart by the first record: a header with ``text`` and ``label`` (any order, other
    columns ignored), or ``label``, ``title`` and ``description`` (0-3, as the hub's AG News); AG News's
    ``Class Index,Title,Description`` header (1-4); no header with 3 fields and an
    integer first (AG News: class 1-4, title, description); no header with 2 fields and an integer second
    (``text,label``). JSON, JSONL and parquet rows need ``text`` and ``label``. BOM, CRLF and integer labels
    written as floats (``3.0``) are accepted (`cookbook.tabular`).

    Raises:
        DataError: a missing or empty file, unknown columns, a row with an extra or a missing field, invalid
            JSON, an empty text or a label that is not an integer in range; CSV and JSONL name the 1-based
            line, a JSON array and parquet the 1-based row.
    """
    p = Path(path)
    if not p.is_file():
        raise DataError(f"{field_name}: {not_a_file(p)}")
    suffix = p.suffix.lower()
    layout, required, kw = "hf", ["text", "label"], {}
    if suffix == ".csv":
        first = first_csv_row(p)
        if first is None:
            raise DataError(f"{path}: the file is empty")
        header = [c.strip().lower() for c in first]
        if "text" in header and "label" in header:
            kw = dict(csv_columns=header)
        elif {"label", *AGNEWS_COLUMNS[1:]} <= set(header):  # title and description, labels 0-3
            layout, kw = "titled", dict(csv_columns=header)
        elif header == ["class index", "title", "description"]:  # AG News with its common header
            layout, kw = "agnews", dict(csv_columns=AGNEWS_COLUMNS)
        elif len(first) == 3 and _is_int(first[0]):
            layout, kw = "agnews", dict(csv_columns=AGNEWS_COLUMNS, csv_header=False)
        elif len(first) == 2 and _is_int(first[1]):
            kw = dict(csv_columns=["text", "label"], csv_header=False)
        else:
            raise DataError(
                f"{path}: unrecognised columns {first[:4]}: expected the AG News layout (class 1-4, title, description; "
                f"no header, or the header Class Index,Title,Description) or the columns 'label' (0-3) and 'text' "
                f"or 'title' and 'description'"
            )
        if layout != "hf":
            required = AGNEWS_COLUMNS
    elif suffix not in (".json", ".jsonl", ".parquet"):
        raise DataError(f"{field_name}: {path}: unsupported file type {suffix!r} (use .csv, .json, .jsonl or .parquet)")
    ds = _normalise(records(p, required=required, **kw), layout)
    if len(ds) == 0:
        raise DataError(f"{path}: no rows")
    return ds


def _normalise(rows, layout: str) -> datasets.Dataset:
    """``(where, row)`` pairs of either layout as ``text`` + ``label`` 0-3, naming the line (or row) of the
    first bad one."""
    offset = 1 if layout == "agnews" else 0  # AG News classes are 1-4
    texts, labels = [], []
    for where, row in rows:
        raw = row["label"]
        try:
            label = to_int(raw)
        except ValueError:
            label = None
        if label is None or not 0 <= label - offset < len(LABELS):
            hint = " (the header 'label' means classes 0-3; for 1-4 use Class Index or no header)" * (
                layout == "titled"
            )
            raise DataError(f"{where}: label {shown(raw)!r} is not one of {offset}-{offset + len(LABELS) - 1}{hint}")
        if layout != "hf":
            text = f"{row['title']} {row['description']}".replace("\\n", " ").strip()
        else:
            text = "" if row["text"] is None else str(row["text"])
        if not text.strip():
            raise DataError(f"{where}: empty text")
        texts.append(text)
        labels.append(label - offset)
    return datasets.Dataset.from_dict({"text": texts, "label": labels})


def load_splits(cfg: DataConfig, seed: int) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Train and validation splits with columns ``text`` and ``label``.

    Raises:
        DataError: a file is missing, has unknown columns, an empty text or a label out of range.
    """
    if cfg.train_files:
        train = datasets.concatenate_datasets([_read_file(f, "data.train_files") for f in cfg.train_files])
        if cfg.eval_files:
            return train, datasets.concatenate_datasets([_read_file(f, "data.eval_files") for f in cfg.eval_files])
    else:
        hub = datasets.load_dataset(cfg.hub_id)
        train = hub["train"]
        if "test" in hub:
            return train, hub["test"]
    parts = train.train_test_split(test_size=cfg.eval_fraction, seed=seed)
    return parts["train"], parts["test"]


def tokenize(ds: datasets.Dataset, tokenizer, cfg: DataConfig) -> tuple[datasets.Dataset, int]:
    """Tokenize to ``input_ids``/``attention_mask``/``labels``; returns the data set and how many
    texts were truncated to ``max_length``.

    One pass of the tokenizer (the start-up of every rank tokenizes both splits): with ``return_overflowing_tokens``
    a text longer than ``max_length`` comes back as its truncated encoding (the first chunk, what ``truncation=True``
    alone gives) followed by chunks of the rest, which are dropped and counted.
    """

    def fn(batch):
        enc = tokenizer(
            batch["text"],
            truncation=True,
            max_length=cfg.max_length,
            return_overflowing_tokens=True,
            padding="max_length" if cfg.padding == "max_length" else False,
        )
        owner = enc.pop("overflow_to_sample_mapping")  # the text of each chunk, in order: 0, 1, 1, 2, ...
        first = [i for i in range(len(owner)) if i == 0 or owner[i] != owner[i - 1]]
        n_long = len({owner[i] for i in range(1, len(owner)) if owner[i] == owner[i - 1]})
        enc = {k: [v[i] for i in first] for k, v in enc.items()}
        enc["labels"] = batch["label"]
        enc["n_truncated"] = [n_long] + [0] * (len(batch["text"]) - 1)
        return enc

    out = ds.map(fn, batched=True, batch_size=1000, remove_columns=ds.column_names, keep_in_memory=True)
    truncated = sum(out["n_truncated"])
    return out.remove_columns("n_truncated"), truncated


def cache_dir(cfg: Config) -> Path | None:
    """``<output_dir>/.cache/tokenized-<key>``: the tokenized splits that ``--check`` writes and every worker
    memory-maps; the key hashes what the tokens depend on (the content of each data file and of the tokenizer
    folder's text files, ``data.max_length``, ``data.padding``, ``data.eval_fraction``, ``train.seed``), so a cache of
    other rows or settings is never read. None for hub data (no local files to key on)."""
    if not cfg.data.train_files:
        return None

    def content(path: str) -> list | str:
        p = Path(path)  # a tokenizer folder: its json, txt and sentencepiece files (not the model's weights)
        files = (
            sorted(f for f in p.iterdir() if f.suffix in (".json", ".txt", ".model"))
            if p.is_dir()
            else [p]
            if p.is_file()
            else []
        )
        return [[f.name, _sha256(f)] for f in files] or path

    key = {
        "train": [content(f) for f in cfg.data.train_files],
        "eval": [content(f) for f in cfg.data.eval_files],
        "tokenizer": content(cfg.model.tokenizer),
        "max_length": cfg.data.max_length,
        "padding": cfg.data.padding,
        "eval_fraction": cfg.data.eval_fraction,
        "seed": cfg.train.seed,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(cfg.output_dir) / ".cache" / f"tokenized-{digest}"


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def tokenized_splits(cfg: Config, tokenizer, write: bool) -> tuple[datasets.Dataset, datasets.Dataset, int, int, bool]:
    """(train, eval, truncated train texts, truncated eval texts, read from the cache): `cache_dir`'s splits
    (memory-mapped Arrow files) when they are complete, else `load_splits` + `tokenize`, saved there when `write`
    (``--check``; atomically: a folder renamed into place, so a worker never reads half a cache).

    Raises:
        DataError: as `load_splits`.
    """
    where = cache_dir(cfg)
    if where is not None and (where / "meta.json").is_file():
        meta = json.loads((where / "meta.json").read_text())
        return (
            datasets.load_from_disk(str(where / "train")),
            datasets.load_from_disk(str(where / "eval")),
            meta["truncated_train"],
            meta["truncated_eval"],
            True,
        )
    train_raw, eval_raw = load_splits(cfg.data, cfg.train.seed)
    train_ds, n_trunc = tokenize(train_raw, tokenizer, cfg.data)
    eval_ds, n_trunc_eval = tokenize(eval_raw, tokenizer, cfg.data)
    if write and where is not None:
        tmp = where.with_name(f"{where.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        train_ds.save_to_disk(str(tmp / "train"))
        eval_ds.save_to_disk(str(tmp / "eval"))
        (tmp / "meta.json").write_text(json.dumps({"truncated_train": n_trunc, "truncated_eval": n_trunc_eval}))
        try:
            os.replace(tmp, where)
        except OSError:  # another process wrote it first
            shutil.rmtree(tmp, ignore_errors=True)
    return train_ds, eval_ds, n_trunc, n_trunc_eval, False


# ----------------------------------------------------------------------------- model
def sdpa_padsafe_attention(module, query, key, value, attention_mask, **kwargs):
    """PyTorch SDPA in which a query row that may see no key attends to every key instead.

    ModernBERT's sliding-window layers give a padding position farther than half a window from
    every real token an all-False mask row. Depending on the shape, PyTorch may pick a CUDA SDPA
    kernel that then returns NaN gradients (seen on H200 with head dim 16, torch 2.11; see
    pytorch/pytorch#109517 and #110213), and the NaN spreads to every weight. Such rows belong to padding, whose outputs are excluded from
    pooling and loss and which no real token attends to, so un-masking them changes no real
    token's value or gradient. Shapes: query (batch, heads, seq, head_dim); attention_mask
    (batch, 1, seq, seq) bool, True = attend.
    """
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        attention_mask = attention_mask | ~attention_mask.any(dim=-1, keepdim=True)
    return _sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


_sdpa_attention_forward = None  # transformers' sdpa_attention_forward, bound by register_attention


def register_attention() -> None:
    """Register ``sdpa_padsafe`` with transformers (attention and mask), before a model is built with it."""
    global _sdpa_attention_forward
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    _sdpa_attention_forward = sdpa_attention_forward
    AttentionInterface.register("sdpa_padsafe", sdpa_padsafe_attention)
    AttentionMaskInterface.register("sdpa_padsafe", sdpa_mask)


def build_model(cfg: ModelConfig, tokenizer, device: torch.device) -> torch.nn.Module:
    """ModernBERT with a 4-way classification head on `device`: pretrained weights, or random init from a config
    (drawn on `device`, not by the CPU's generator on one thread; DDP then broadcasts rank 0's weights).

    Raises:
        ConfigError: the tokenizer has more tokens than the model's vocabulary.
    """
    # problem_type fixed here: the model's forward sets it on its first call with labels, and that change of the
    # config fails torch.compile's guard on it, so the whole model would be compiled a second time at step 2.
    from transformers import AutoModelForSequenceClassification

    register_attention()
    kwargs = dict(
        num_labels=len(LABELS),
        id2label=dict(enumerate(LABELS)),
        label2id={n: i for i, n in enumerate(LABELS)},
        problem_type="single_label_classification",
        attn_implementation=cfg.attn_implementation,
    )
    if cfg.pretrained:
        model = AutoModelForSequenceClassification.from_pretrained(cfg.name_or_path, **kwargs).to(device)
    else:
        with torch.device(device):
            model = AutoModelForSequenceClassification.from_config(
                AutoConfig.from_pretrained(cfg.name_or_path, **kwargs)
            )
    if len(tokenizer) > model.config.vocab_size:
        raise ConfigError(
            f"model.tokenizer has {len(tokenizer)} tokens but the model's vocab_size is "
            f"{model.config.vocab_size}: use the model's own tokenizer"
        )
    return model


def compile_model(model: torch.nn.Module, scope: str, backend: str | Callable = "inductor") -> None:
    """``torch.compile`` the model in place (checkpoint keys unchanged): ``scope="model"`` traces the whole model into
    one graph; ``scope="layers"`` compiles each encoder layer on its own ("regional compilation", PyTorch tutorial
    "Reducing torch.compile cold start compilation time with regional compilation"). The layers run the same code, so
    ModernBERT-base's 22 share 2 graphs (layer 0, which has no attention norm, and the rest: global and local layers
    differ only in their mask tensors; a batch without padding, whose mask is None, adds one) and compiling takes
    about the time of 2 layers; the embeddings and the head run eagerly.

    Raises:
        ValueError: `scope` is neither "model" nor "layers".
    """
    if scope == "model":
        model.compile(backend=backend)
    elif scope == "layers":
        for layer in model.model.layers:
            layer.compile(backend=backend)
    else:
        raise ValueError(f"compile scope {scope!r}: use 'model' or 'layers'")


def run_eval(model: torch.nn.Module, loader, device: torch.device, autocast, compiled: bool) -> dict[str, float]:
    """`evaluate`, with the compiled model when `compiled`, else eagerly (``torch.compiler.set_stance("force_eager")``
    skips the compiled code of a ``model.compile()`` model, and compiles nothing).

    Why eager by default (reasoned, not yet measured on GPU): a compiled training graph does not serve evaluation
    (eval mode, ``no_grad`` and another batch size each fail its guards), so the first evaluation compiles a graph
    of its own (and a short last batch may compile another), which costs tens of seconds, while a forward pass
    alone over a validation split of a few thousand rows takes about a second eagerly on a GPU, so compiling pays
    only after many evaluations of a large split.
    """
    with contextlib.nullcontext() if compiled else torch.compiler.set_stance("force_eager"):
        return evaluate(model, loader, device, autocast)


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader, device: torch.device, autocast) -> dict[str, float]:
    """Loss, accuracy and macro-F1 over the whole validation split (every rank's shard), from one confusion
    matrix summed over ranks; macro-F1 averages the classes that occur as a label or a prediction (torchmetrics'
    ``MulticlassF1Score(average="macro")``)."""
    model.eval()
    n = len(LABELS)
    confusion = torch.zeros(n * n, device=device, dtype=torch.float64)  # row: label, column: prediction
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with autocast():
            out = model(**batch)
        loss_sum += out.loss.double() * batch["labels"].numel()
        confusion += torch.bincount(batch["labels"] * n + out.logits.argmax(-1), minlength=n * n).double()
    totals = cookbook.all_reduce_sum({"loss": loss_sum, **{f"c{i}": c for i, c in enumerate(confusion)}}, device)
    model.train()
    cm = torch.tensor([totals[f"c{i}"] for i in range(n * n)], dtype=torch.float64).view(n, n)
    count = float(cm.sum())
    tp, fp, fn = cm.diag(), cm.sum(0) - cm.diag(), cm.sum(1) - cm.diag()
    seen = tp + fp + fn > 0
    f1 = (2 * tp / (2 * tp + fp + fn).clamp(min=1))[seen].mean().item() if bool(seen.any()) else 0.0
    return {
        "loss": totals["loss"] / max(count, 1.0),
        "accuracy": float(tp.sum()) / max(count, 1.0),
        "macro_f1": f1,
        "samples": count,
    }


# ----------------------------------------------------------------------------- recipe
def preflight(cfg: Config, world_size: int) -> str:
    """What ``--check`` runs in one process before torchrun starts any worker (launch.sh); returns what the data holds."""
    lm.check_attention(cfg.model.attn_implementation, on_cpu=cookbook.get_dist_info().device.type == "cpu")
    check_local_model(cfg.model.name_or_path, "model.name_or_path")
    check_local_model(cfg.model.tokenizer, "model.tokenizer", tokenizer=True)
    try:
        tok = AutoTokenizer.from_pretrained(cfg.model.tokenizer)
        config = AutoConfig.from_pretrained(cfg.model.name_or_path)
    except (OSError, ValueError) as exc:  # ValueError: a folder whose tokenizer files transformers cannot read
        raise ConfigError(
            f"model.name_or_path / model.tokenizer: cannot load {cfg.model.name_or_path!r}: {str(exc).splitlines()[0]}"
        ) from None
    if len(tok) > config.vocab_size:
        raise ConfigError(f"model.tokenizer has {len(tok)} tokens but the model's vocab_size is {config.vocab_size}")
    # local files: read, checked and tokenized once here; the workers memory-map the result (cache_dir)
    train_ds, eval_ds = tokenized_splits(cfg, tok, write=True)[:2] if cfg.data.train_files else (None, None)
    per_step = cfg.train.micro_batch_size * cfg.train.grad_accum_steps * world_size
    if train_ds is not None and len(train_ds) < per_step:
        raise ConfigError(
            f"the training set ({len(train_ds)} rows) is too small for one step of "
            f"{cfg.train.micro_batch_size} x {cfg.train.grad_accum_steps} x {world_size} samples"
        )
    Checkpointer(Path(cfg.output_dir) / "checkpoints", resizable=RESIZABLE).check_resume(
        cfg.checkpoint.resume, world_size, to_dict(cfg), MAY_CHANGE, cfg.train.stop_at_step
    )
    return (
        f"{len(train_ds)} train / {len(eval_ds)} eval rows"
        if train_ds is not None
        else f"hub data set {cfg.data.hub_id}"
    )


def load(path: str, overrides: list[str]) -> Config:
    cfg = load_config(Config, path, overrides)
    check_config(cfg, Path(path).resolve().parent)
    return cfg


@cookbook.cli(load, preflight)  # --check: preflight
def main(cfg: Config) -> None:
    # ---- set-up
    register_attention()  # the rest of the imports: transformers' modeling code
    launched = launch_time()
    phases = {
        "worker_start": psutil.Process().create_time(),
        "module_start": STARTED,
        "imports": time.time(),
    }  # seconds after the launch, below
    info = cookbook.init_distributed(cfg.train.collective_timeout_s, debug_dir=Path(cfg.output_dir) / "debug")
    phases["distributed"] = time.time()
    out_dir = Path(cfg.output_dir)
    torch.manual_seed(cfg.train.seed)
    use_bf16 = info.device.type == "cuda" and cfg.train.mixed_precision == "bf16"
    autocast = partial(torch.autocast, info.device.type, dtype=torch.bfloat16, enabled=use_bf16)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer)
    train_ds, eval_ds, n_trunc, n_trunc_eval, cached = tokenized_splits(cfg, tokenizer, write=False)
    phases["data"] = time.time()
    collate = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)
    # DistributedSampler's order and split, with a global position: a checkpoint resumes on another world size.
    # Run calls its set_epoch at each pass (a new shuffle per epoch).
    sampler = ResizableSampler(
        train_ds, num_replicas=info.world_size, rank=info.rank, shuffle=True, seed=cfg.train.seed, drop_last=True
    )
    # Loader processes live for the whole run (persistent_workers), so no epoch and no evaluation waits for new
    # ones: the rows are tokenized already and the collator pads them, nothing in a worker depends on the epoch
    # or on a random stream, so a kept worker gives what a fresh one would. The sampler runs in this process
    # (set_epoch reaches it), and StatefulDataLoader restores a mid-epoch position either way.
    loader_kw = dict(
        collate_fn=collate,
        num_workers=cfg.data.num_workers,
        pin_memory=info.device.type == "cuda",
        persistent_workers=cfg.data.num_workers > 0,
    )
    train_loader = StatefulDataLoader(
        train_ds, batch_size=cfg.train.micro_batch_size, sampler=sampler, drop_last=True, **loader_kw
    )
    # Each rank evaluates a disjoint slice; no sample is duplicated to even out the shards.
    eval_shard = Subset(eval_ds, range(info.rank, len(eval_ds), info.world_size))
    eval_loader = StatefulDataLoader(eval_shard, batch_size=cfg.train.micro_batch_size * 2, **loader_kw)

    steps_per_epoch = len(train_loader) // cfg.train.grad_accum_steps
    if steps_per_epoch == 0:
        raise ConfigError(
            f"the training set ({len(train_ds)} rows) is too small for one step of "
            f"{cfg.train.micro_batch_size} x {cfg.train.grad_accum_steps} x {info.world_size} samples"
        )
    max_steps = cfg.train.max_steps if cfg.train.max_steps > 0 else cfg.train.epochs * steps_per_epoch

    model = build_model(cfg.model, tokenizer, info.device)
    if cfg.train.activation_checkpointing == "full":  # recompute each encoder layer in backward
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    flops = ModelFlops(count_parameters(model), model.config.num_hidden_layers, model.config.hidden_size)
    if cfg.model.compile:
        compile_model(model, cfg.model.compile_scope)
    model = DDP(model, device_ids=[info.local_rank] if info.device.type == "cuda" else None, **cfg.ddp.kwargs())
    phases["model"] = time.time()

    optimizer, scheduler = build_optimizer(
        cfg.optim, model.parameters(), max_steps, fused=info.device.type == "cuda", decay_1d=False
    )

    global_batch = cfg.train.micro_batch_size * cfg.train.grad_accum_steps * info.world_size
    startup_phases = {k: round(t - launched, 3) for k, t in phases.items()}
    with Run(
        cfg,
        info,
        app=ModelOptimizerState(model, optimizer),
        scheduler=scheduler,
        loader=train_loader,
        may_change=MAY_CHANGE,
        max_steps=max_steps,
        experiment="modernbert-ddp",
        final=out_dir / "final" if cfg.checkpoint.export_hf else None,
        flops=flops,
        evaluate=lambda: run_eval(model.module, eval_loader, info.device, autocast, compiled=cfg.model.compile_eval),
    ) as run:
        run.say(
            f"world size {info.world_size} ({info.backend}, {info.device.type}) | {flops.num_params / 1e6:.1f} M "
            f"non-embedding params | global batch {global_batch} = {cfg.train.micro_batch_size} micro-batch x "
            f"{cfg.train.grad_accum_steps} accumulation x {info.world_size} ranks | {len(train_ds)} train / "
            f"{len(eval_ds)} eval rows | {max_steps} steps ({steps_per_epoch}/epoch) | precision "
            f"{'bf16 autocast' if use_bf16 else 'fp32'}"
        )
        run.say(
            f"start-up (s after the launch): {startup_phases} | tokenized splits "
            f"{'memory-mapped from ' + str(cache_dir(cfg)) if cached else 'tokenized here'}"
        )
        if n_trunc or n_trunc_eval:
            run.say(
                f"truncated to data.max_length={cfg.data.max_length}: {n_trunc} train and {n_trunc_eval} eval texts"
            )

        # ---- train loop
        for _ in run.steps():
            optimizer.zero_grad(set_to_none=True)  # also drops a skipped step's gradients
            micro_batches, waits = run.take(cfg.train.grad_accum_steps)
            step_loss = torch.zeros((), device=info.device)
            for i, (batch, wait) in enumerate(zip(micro_batches, waits)):
                # Skip DDP's gradient all-reduce on all but the last micro-batch of a step.
                with model.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
                    with autocast():
                        loss = model(**batch).loss / cfg.train.grad_accum_steps
                    loss.backward()
                step_loss += loss.detach()
                run.metrics.add(samples=batch["labels"].numel(), tokens=batch["attention_mask"].sum(), data_wait_s=wait)
            grad_norm = torch.nn.utils.clip_grad_norm_(  # max_grad_norm 0: no clipping, but the norm is checked
                model.parameters(), cfg.optim.max_grad_norm if cfg.optim.max_grad_norm > 0 else float("inf")
            )
            if run.skip_step(grad_norm):
                continue  # NaN / inf: the run stops, or (train.on_nonfinite=skip) the step is dropped
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            run.end_step(step_loss, lr=lr, grad_norm=grad_norm)

        # ---- save
        run.finish(
            export=lambda: {
                "export_dir": (
                    export_hf(model, out_dir / "final", tokenizer) if cfg.checkpoint.export_hf else None,
                    "AutoModelForSequenceClassification.from_pretrained",
                )
            },
            summary=lambda: {
                "param_fingerprints": cookbook.all_gather_object(cookbook.param_fingerprint(model.module)),
                "startup_phases": startup_phases,
                "tokenized_cache": cached,
            },
        )

    # ---- clean-up
    cookbook.destroy_distributed()


if __name__ == "__main__":
    cookbook.run_main(main, user_errors=(ConfigError, DataError, CheckpointError))
