"""Click-through-rate prediction with DLRM whose embedding tables are sharded by TorchRec.

Commands (from this folder; NGPU defaults to all visible GPUs, else 2 CPU processes):

    ./launch.sh                                             # Criteo (Kaggle DAC train.txt), all GPUs of this node
    CONFIG_FILE=tiny.yaml ./launch.sh                       # generated Criteo-format rows, CPU-friendly
    CONFIG_FILE=tiny.yaml ./launch.sh sharding.plan=row_wise 'sharding.tables={C1: data_parallel}'
    NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 ./launch.sh   # each node

``build_model`` puts the tables on the meta device; ``sharding_plan`` and ``shard_model`` place them with
``DistributedModelParallel`` (table-, row-, column-wise or data parallel; the MLPs under DDP) with the sparse
optimizer fused into FBGEMM's backward; ``main`` is the loop. What it supports (Criteo formats, conversion,
sharding, checkpoints): README.md beside this file.
"""

from __future__ import annotations

import math
import numbers
import os
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

warnings.filterwarnings("ignore", module="torchrec")
warnings.filterwarnings("ignore", message=".*(TypedStorage|_get_pg_default_device|DistributedDataParallel).*")
# TorchRec 1.8 calls the c10d collectives that torch 2.13 renamed, and FBGEMM's CPU lookup of data-parallel
# tables has no registered autograd kernel (its gradient is correct: tests/test_torchrec_dlrm.py compares it).
warnings.filterwarnings("ignore", message=".*(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated.*")
warnings.filterwarnings("ignore", message="fbgemm::dense_embedding_codegen_lookup_function: an autograd kernel")

import logging

import cookbook  # first: a package built for another torch is one line (cookbook.builds)
import numpy as np
import torch
import torch.distributed as dist
from torchmetrics.classification import BinaryAUROC
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.datasets.utils import Batch
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan, data_parallel, row_wise
from torchrec.distributed.sharding_plan import table_wise
from torchrec.distributed.types import ShardingPlan
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from cookbook.checkpoint import Checkpointer, CheckpointError, TrainState
from cookbook import config
from cookbook.config import ConfigError, check_fields, load_config, to_dict
from cookbook.hub import resolve_path
from cookbook.loop import Run
from cookbook import tabular
import text_files  # file_to_text, dataset_to_text: beside this file
from cookbook.errors import not_a_file
from cookbook.tabular import DataError, check_int64, shown, to_int

logging.getLogger("torchrec").setLevel(logging.ERROR)  # TorchRec logs planner and caching notices at WARNING on every
logging.getLogger().addFilter(  # rank, some through the root logger: those are dropped there, others' warnings kept
    lambda record: record.levelno >= logging.ERROR or f"{os.sep}torchrec{os.sep}" not in record.pathname
)
CANNOT_REMAP = (
    "its data position counts global batches of world_size x train.batch_size rows, so on another number "
    "of ranks it would point at other rows and the steps per epoch would change"
)

DENSE = [f"I{i}" for i in range(1, 14)]
CATEGORICAL = [f"C{i}" for i in range(1, 27)]
COLUMNS = ["label", *DENSE, *CATEGORICAL]
CONVERTED_SUFFIXES = (".csv", ".json", ".jsonl", ".parquet")  # converted once to Criteo text (criteo_text_file)
SHARDING_TYPES = ("table_wise", "row_wise", "column_wise", "data_parallel")


# ----------------------------------------------------------------------------- config
@dataclass
class ModelConfig:
    # Rows per table, C1..C26: one value for all, or 26. Ids are the hex hash modulo this size.
    table_sizes: list[int] = field(default_factory=lambda: [1_000_000])
    embedding_dim: int = 128
    dense_arch: list[int] = field(default_factory=lambda: [512, 256, 128])  # last = embedding_dim
    over_arch: list[int] = field(default_factory=lambda: [1024, 1024, 512, 256, 1])  # last = 1


@dataclass
class ShardingConfig:
    plan: str = "auto"  # auto (TorchRec's planner), table_wise, row_wise, column_wise, data_parallel
    tables: dict[str, str] = field(default_factory=dict)  # per-table kind, e.g. {C3: row_wise, C9: data_parallel}


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=lambda: ["data/criteo/train.txt"])
    hub_id: str = ""  # a Hugging Face data set with columns label, I1..I13, C1..C26; used when train_files is empty
    hub_split: str = "train"
    hub_max_rows: int = 0  # rows to take from the hub data set (0: all)
    eval_files: list[str] = field(default_factory=list)  # empty: every holdout_every-th row of train_files
    holdout_every: int = 20  # 0: no validation (when eval_files is empty)
    max_eval_rows: int = 1_000_000
    check_rows: int = 100_000  # rows per file that --check parses before start (0: all)


@dataclass
class OptimConfig:
    sparse: str = "rowwise_adagrad"  # rowwise_adagrad or sgd, for the embedding tables
    sparse_lr: float = 0.02
    dense: str = "adagrad"  # adagrad or sgd, for the MLPs
    dense_lr: float = 0.02
    eps: float = 1e-8


@dataclass
class TrainConfig:
    seed: int = 42
    batch_size: int = 8192  # rows per rank per step
    epochs: int = 1
    max_steps: int = -1
    stop_at_step: int = -1
    pipeline: bool = True  # GPU: TrainPipelineSparseDist (ignored on CPU)
    log_every: int = 100
    eval_every: int = 0  # 0: at the end only
    profile_step: int = 0
    on_nonfinite: str = "stop"  # a step with a NaN/inf loss: stop (exit 4) or skip (GPU pipeline: always stop)
    max_consecutive_skips: int = 5  # on_nonfinite=skip: the run stops at one more non-finite step in a row
    collective_timeout_s: float = 1800.0  # a collective waiting longer ends the run, naming the rank that is behind


@dataclass
class Config(config.RunConfig):
    model: ModelConfig = field(default_factory=ModelConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


# Settings that may differ between a checkpoint and the run that resumes it; any other change is refused.
MAY_CHANGE = (*config.MAY_CHANGE, "train.pipeline", "data.check_rows", "data.max_eval_rows")


def table_sizes(cfg: ModelConfig) -> list[int]:
    return cfg.table_sizes * 26 if len(cfg.table_sizes) == 1 else list(cfg.table_sizes)


def check_config(cfg: Config, config_dir: Path) -> None:
    """Resolve paths against the config file's folder, reject incompatible values, then point the data lists
    at Criteo text: CSV, JSON, JSONL and parquet files are converted once (`criteo_text_file`).

    Raises:
        ConfigError: an invalid setting or a missing data file. DataError: a malformed file to convert.
    """
    cfg.data.train_files = [resolve_path(f, config_dir) for f in cfg.data.train_files]
    cfg.data.eval_files = [resolve_path(f, config_dir) for f in cfg.data.eval_files]
    m = cfg.model
    if len(m.table_sizes) not in (1, 26):
        raise ConfigError(f"model.table_sizes has {len(m.table_sizes)} values: give one (every table) or 26 (C1..C26)")
    for name, size in zip(CATEGORICAL, table_sizes(m)):
        if size < 1:
            raise ConfigError(f"model.table_sizes: table {name} has {size} rows; every table needs at least 1")
    if not m.dense_arch or m.dense_arch[-1] != m.embedding_dim:
        raise ConfigError(
            f"model.dense_arch must end with model.embedding_dim={m.embedding_dim} (the dense features "
            f"join the embeddings in the interaction), got {m.dense_arch}"
        )
    if len(m.over_arch) < 2 or m.over_arch[-1] != 1:
        raise ConfigError(
            f"model.over_arch needs at least 2 layers and must end with 1 (the click logit), got {m.over_arch}"
        )
    kinds = {cfg.sharding.plan, *cfg.sharding.tables.values()}
    if not kinds <= {"auto", *SHARDING_TYPES}:
        raise ConfigError(
            f"sharding.plan / sharding.tables: kinds are auto, {', '.join(SHARDING_TYPES)}; got "
            f"{sorted(kinds - {'auto', *SHARDING_TYPES})}"
        )
    unknown = sorted(set(cfg.sharding.tables) - set(CATEGORICAL))
    if unknown:
        raise ConfigError(f"sharding.tables: no table named {unknown} (tables are C1..C26)")
    if "auto" in cfg.sharding.tables.values():
        raise ConfigError("sharding.tables: name a kind per table; 'auto' is for sharding.plan")
    config.check_run(cfg)
    check_fields(
        cfg,
        at_least={"train.batch_size": 1, "model.embedding_dim": 1},
        one_of={"optim.sparse": ("rowwise_adagrad", "sgd"), "optim.dense": ("adagrad", "sgd")},
        within={"optim.sparse_lr": "(0, inf)", "optim.dense_lr": "(0, inf)"},
    )
    if not cfg.data.train_files and cfg.data.hub_id:  # --check writes the hub rows here, before any worker starts
        cfg.data.train_files = [str(hub_file(cfg))]
    if not cfg.data.train_files:
        raise ConfigError("data.train_files is empty: give Criteo-format text files (or data.hub_id)")
    if cfg.data.holdout_every < 0 or cfg.data.holdout_every == 1:
        raise ConfigError(f"data.holdout_every must be 0 (off) or >= 2, got {cfg.data.holdout_every}")
    # Last, once the settings are known to be valid: a conversion reads the whole file.
    cfg.data.train_files = [criteo_text_file(f, cfg.output_dir) for f in cfg.data.train_files]
    cfg.data.eval_files = [criteo_text_file(f, cfg.output_dir) for f in cfg.data.eval_files]


def check_sharding(cfg: Config, world_size: int, on_cpu: bool) -> None:
    """Refuse, before start, sharding choices this world size or device cannot run."""
    kinds = table_kinds(cfg.sharding)
    if "column_wise" in kinds.values() and cfg.model.embedding_dim % world_size:
        raise ConfigError(
            f"column_wise splits each table's {cfg.model.embedding_dim} columns over {world_size} ranks: "
            f"model.embedding_dim must be a multiple of the world size"
        )
    small = [n for n, s in zip(CATEGORICAL, table_sizes(cfg.model)) if kinds[n] == "row_wise" and s < world_size]
    if small:
        raise ConfigError(f"row_wise tables need at least one row per rank ({world_size}); {small} are smaller")
    if on_cpu and "auto" in kinds.values() and "row_wise" in kinds.values():
        raise ConfigError(
            "on CPU TorchRec's planner offers no row_wise: name a kind for every table "
            "(sharding.plan=<kind> plus sharding.tables) so the plan is built by hand"
        )


# ----------------------------------------------------------------------------- data
HUB_FORMAT = 2  # of the lines criteo_line writes for a hub data set; a file written by another version is written again


def hub_file(cfg: Config) -> Path:
    """Where --check writes the rows of ``data.hub_id`` as Criteo text (in ``output_dir``, read by every rank)."""
    return Path(cfg.output_dir) / "hub_data" / f"{cfg.data.hub_id.replace('/', '__')}-{cfg.data.hub_split}.txt"


def criteo_line(row: Mapping[str, Any], where: str, positions: Mapping[str, int] | None = None) -> str:
    """One row with Criteo's columns (``label``, ``I1``..``I13``, ``C1``..``C26``) as a line of Criteo text.

    Values may be strings or numbers, as CSV, JSON, parquet and hub data sets give them: a label 0/1, counts
    as integers or integer-valued floats (``260.0``, as pandas writes an integer column with missing values),
    categories as hex strings (or integers, written in hex so that `parse_row` reads the same id back). None,
    ``""`` and NaN are missing values (an empty field).

    Args:
        row: column name -> value (other columns are ignored).
        where: ``"<file> line 7"`` / ``"<file> row 7"``, for messages.
        positions: column name -> 1-based column number in the source, for messages (None: names only).

    Raises:
        DataError: ``"<where>, column 5 (I4): '2.5' is not an integer"``, a label that is not 0 or 1, or a
            category that is not hexadecimal.
    """

    def bad(name: str, value: Any, what: str) -> DataError:
        col = f"column {positions[name]} ({name})" if positions else f"column {name}"
        return DataError(f"{where}, {col}: {_short(value)} {what}")

    out = []
    for name in COLUMNS[:14]:  # label and counts
        try:
            n = to_int(row[name])
        except ValueError as exc:
            n, why = "bad", ("is outside the 64-bit integer range" if "64-bit" in str(exc) else "is not an integer")
        if name == "label" and n not in (0, 1):
            raise bad(name, row[name], "is not 0 or 1")
        if n == "bad":
            raise bad(name, row[name], why)
        out.append("" if n is None else str(n))
    for name in CATEGORICAL:
        value = row[name].strip() if isinstance(row[name], str) else row[name]
        if value is None or value == "" or (isinstance(value, float) and math.isnan(value)):
            out.append("")
        elif isinstance(value, numbers.Integral) and not isinstance(value, bool):
            out.append(format(int(value), "x"))
        else:
            try:
                int(value, 16)  # a str that is not hex, or a float / bool, raises
            except (ValueError, TypeError):
                raise bad(name, row[name], "is not a hexadecimal hash") from None
            out.append(value)
    return "\t".join(out) + "\n"


def criteo_text_file(path: str, output_dir: str) -> str:
    """The Criteo text file to read for `path`: `path` itself, or for CSV, JSON, JSONL and parquet files
    (`CONVERTED_SUFFIXES`) ``<output_dir>/converted/<name>-<hash of its content>.txt``, converted once
    (`text_files.file_to_text`: a CSV file has a header naming the 40 columns, or none and those columns
    in order; values as in `criteo_line`).

    Raises:
        ConfigError: the file does not exist.
        DataError: a missing column, a row with an extra or a missing field, or a bad value, naming the file,
            the 1-based line (CSV, JSONL) or row (JSON array, parquet) and the column.
    """
    if Path(path).suffix.lower() not in CONVERTED_SUFFIXES:
        return path
    dst, n = text_files.file_to_text(path, Path(output_dir) / "converted", criteo_line, COLUMNS)
    if n is not None:
        print(f"{path}: {n} rows converted to Criteo text in {dst}")
    return str(dst)


def _short(value: Any) -> str:
    """`value` as the file wrote it, quoted (`cookbook.tabular.shown`: JSON ``true``, not ``True``), its middle elided
    past 40 characters (a 400-digit count stays one readable line)."""
    text = repr(shown(value))
    return text if len(text) <= 40 else f"{text[:18]}...{text[-18:]}"


def parse_row(line: str, sizes: list[int], where: str) -> tuple[float, list[float], list[int]]:
    """One Criteo row: label, 13 log-transformed counts, 26 ids (-1: missing), each hashed into its table.
    Integer-valued floats (``260.0``, label ``1.0``) are read as integers; a line may end in LF or CRLF.

    Raises:
        DataError: ``"<where>: 39 tab-separated fields, expected 40 (...)"``, ``"<where>, column 5 (I4): '2.5'
            is not an integer"``, a label that is not 0 or 1, a category that is not hexadecimal.
    """
    fields = line.rstrip("\r\n").split("\t")
    if len(fields) != 40:
        raise DataError(f"{where}: {len(fields)} tab-separated fields, expected 40 (label, I1-I13, C1-C26)")
    try:
        label = int(fields[0]) if fields[0] in ("0", "1") else to_int(fields[0])
    except ValueError:
        label = None
    if label not in (0, 1):
        raise DataError(f"{where}, column 1 (label): {fields[0]!r} is not 0 or 1")
    dense = []
    for col, value in enumerate(fields[1:14], start=2):
        try:
            n = check_int64(int(value)) if value else 0
        except ValueError:  # written otherwise than as a plain integer: "260.0" is 260, NaN 0
            try:
                n = to_int(value) or 0
            except ValueError as exc:
                what = "is outside the 64-bit integer range" if "64-bit" in str(exc) else "is not an integer"
                raise DataError(f"{where}, column {col} ({COLUMNS[col - 1]}): {_short(value)} {what}") from None
        dense.append(math.log1p(n) if n > 0 else 0.0)
    ids = []
    for col, (value, size) in enumerate(zip(fields[14:], sizes), start=15):
        try:
            ids.append(int(value, 16) % size if value else -1)
        except ValueError:
            raise DataError(
                f"{where}, column {col} ({COLUMNS[col - 1]}): {value!r} is not a hexadecimal hash"
            ) from None
    return float(label), dense, ids


def to_batch(rows: list[tuple[float, list[float], list[int]]], weights: list[float] | None = None) -> Batch:
    """Rows as TorchRec's ``Batch``: dense (B, 13), a KeyedJaggedTensor of the 26 features (one id or an
    empty bag per row and feature) and labels (B,). `weights` (0 for padding rows) ride along for evaluation."""
    labels = torch.tensor([r[0] for r in rows])
    dense = torch.tensor([r[1] for r in rows], dtype=torch.float32)
    ids = np.array([r[2] for r in rows], dtype=np.int64).T  # (26, B), feature-major as the KJT wants
    present = ids >= 0
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=CATEGORICAL,
        values=torch.from_numpy(ids[present]),
        lengths=torch.from_numpy(present.reshape(-1).astype(np.int32)),
    )
    batch = Batch(dense_features=dense, sparse_features=kjt, labels=labels)
    if weights is not None:
        batch.weights = torch.tensor(weights)  # type: ignore[attr-defined]
    return batch


def split_lines(files: list[str], holdout_every: int, split: str) -> Iterator[tuple[str, str]]:
    """(where, line) of the train or eval split: every holdout_every-th line is eval (0: all train). A UTF-8
    BOM and a header line (``label<TAB>I1...``, line 1) are skipped; CRLF line ends read as LF."""
    for path in files:
        with open(path, encoding="utf-8-sig") as f:
            try:
                for i, line in enumerate(f, start=1):
                    if i == 1 and line.startswith("label\t"):
                        continue
                    held = holdout_every > 0 and i % holdout_every == 0
                    if split == "all" or held == (split == "eval"):
                        yield f"{path} line {i}", line
            except UnicodeDecodeError as exc:
                raise tabular.not_utf8(Path(path), exc) from None


class CriteoStream:
    """Global batches of ``world_size x batch_size`` consecutive rows; this rank parses rows
    ``[rank * B, (rank + 1) * B)`` of each. Deterministic, so the data position is (epoch, batches done in it):
    a resume skips that many batches without parsing them. A tail shorter than a global batch is dropped.

    The position (a DCP `Stateful`) is that of the last batch the loop *finished* (`finished`), not the last one
    read: the GPU pipeline reads one batch ahead."""

    def __init__(self, cfg: Config, rank: int, world_size: int):
        self.files = cfg.data.train_files
        self.split = "train" if not cfg.data.eval_files else "all"
        self.holdout_every = cfg.data.holdout_every
        self.sizes = table_sizes(cfg.model)
        self.rank, self.world_size, self.batch_size = rank, world_size, cfg.train.batch_size
        self.epoch = self.batches = 0
        self._read: list[tuple[float, tuple[int, int]]] = []  # (seconds waited, position) of batches read, oldest first

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batches": self.batches}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.batches = int(state["epoch"]), int(state["batches"])

    def __len__(self) -> int:
        """Global batches in one pass over the training split (counts lines; no parsing)."""
        return sum(1 for _ in split_lines(self.files, self.holdout_every, self.split)) // (
            self.world_size * self.batch_size
        )

    def timed(self) -> Iterator[Batch]:
        """The batches of `__iter__`, each timed and queued with its position until the loop has `finished` it."""
        it = iter(self)
        while True:
            t0 = time.perf_counter()
            batch, position = next(it)
            self._read.append((time.perf_counter() - t0, position))
            yield batch

    def finished(self) -> float:
        """The loop finished the oldest batch read by `timed`: its position becomes the saved one. Returns the
        seconds the loop waited for that batch."""
        wait, (self.epoch, self.batches) = self._read.pop(0)
        return wait

    def __iter__(self) -> Iterator[tuple[Batch, tuple[int, int]]]:
        """Endless: (batch, its position) epoch after epoch, starting after the saved position."""
        epoch, skip = self.epoch, self.batches
        n_global = self.world_size * self.batch_size
        lo, hi = self.rank * self.batch_size, (self.rank + 1) * self.batch_size
        while True:
            done, chunk = 0, []
            for where, line in split_lines(self.files, self.holdout_every, self.split):
                chunk.append((where, line))
                if len(chunk) < n_global:
                    continue
                done += 1
                if done > skip:
                    yield to_batch([parse_row(line, self.sizes, w) for w, line in chunk[lo:hi]]), (epoch, done)
                chunk = []
            if done == 0:
                raise DataError(
                    f"{', '.join(self.files)}: fewer than {n_global} training rows, too few for one "
                    f"step of {self.batch_size} rows x {self.world_size} ranks"
                )
            epoch, skip = epoch + 1, 0


def eval_batches(cfg: Config, rank: int, world_size: int) -> list[Batch]:
    """This rank's validation batches, the same number on every rank (the tables' all-to-alls are collective):
    the last global batch is padded with weight-0 copies."""
    if cfg.data.eval_files:
        lines = split_lines(cfg.data.eval_files, 0, "all")
    elif cfg.data.holdout_every > 0:
        lines = split_lines(cfg.data.train_files, cfg.data.holdout_every, "eval")
    else:
        return []
    sizes, rows, total = table_sizes(cfg.model), [], 0
    for where, line in lines:
        if total == cfg.data.max_eval_rows:
            break
        if total % world_size == rank:
            rows.append(parse_row(line, sizes, where))
        total += 1
    if total == 0:
        return []
    per_rank = -(-total // world_size)
    weights = [1.0] * len(rows) + [0.0] * (per_rank - len(rows))
    rows += [rows[0] if rows else (0.0, [0.0] * 13, [-1] * 26)] * (per_rank - len(rows))
    B = cfg.train.batch_size
    return [to_batch(rows[i : i + B], weights[i : i + B]) for i in range(0, per_rank, B)]


def check_data(cfg: Config, world_size: int) -> str:
    """Parse the first ``data.check_rows`` rows of every file (all with 0); raise DataError on the first bad one."""
    sizes, counts = table_sizes(cfg.model), {}
    for path in [*cfg.data.train_files, *cfg.data.eval_files]:
        if not Path(path).is_file():
            raise ConfigError(not_a_file(path, "data file"))
        n = 0
        for where, line in split_lines([path], 0, "all"):
            parse_row(line, sizes, where)
            n += 1
            if n == cfg.data.check_rows:
                break
        if n == 0:
            raise DataError(f"{path}: no rows (an empty file, or a header line alone)")
        counts[path] = n
    total = sum(counts[p] for p in cfg.data.train_files)
    train = total if cfg.data.eval_files or not cfg.data.holdout_every else total - total // cfg.data.holdout_every
    if (cfg.data.check_rows == 0 or total < cfg.data.check_rows) and train < world_size * cfg.train.batch_size:
        raise ConfigError(
            f"{train} training rows are too few for one step of {cfg.train.batch_size} rows x "
            f"{world_size} ranks: lower train.batch_size"
        )
    return f"{total} rows checked" + (
        "" if cfg.data.check_rows == 0 else f", the first {cfg.data.check_rows} of each file"
    )


# ----------------------------------------------------------------------------- model
def table_kinds(cfg: ShardingConfig) -> dict[str, str]:
    return {name: cfg.tables.get(name, cfg.plan) for name in CATEGORICAL}


def build_model(cfg: Config, device: torch.device) -> DLRMTrain:
    """DLRM with its tables on the meta device (no memory until sharded) and its MLPs on `device`."""
    tables = [
        EmbeddingBagConfig(name=name, embedding_dim=cfg.model.embedding_dim, num_embeddings=size, feature_names=[name])
        for name, size in zip(CATEGORICAL, table_sizes(cfg.model))
    ]
    torch.manual_seed(cfg.train.seed)
    return DLRMTrain(
        DLRM(
            embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
            dense_in_features=len(DENSE),
            dense_arch_layer_sizes=cfg.model.dense_arch,
            over_arch_layer_sizes=cfg.model.over_arch,
            dense_device=device,
        )
    )


def sparse_optimizer(cfg: OptimConfig) -> tuple[type[torch.optim.Optimizer], dict]:
    if cfg.sparse == "rowwise_adagrad":
        return RowWiseAdagrad, {"lr": cfg.sparse_lr, "eps": cfg.eps}
    return torch.optim.SGD, {"lr": cfg.sparse_lr}


def sharding_plan(cfg: Config, model: DLRMTrain, info: cookbook.DistInfo) -> ShardingPlan:
    """Every table's kind given: a hand-built plan (table-wise tables go largest first to the rank with the
    fewest rows so far; row- and column-wise tables span every rank). Otherwise TorchRec's planner, held to the
    kinds that are given."""
    ebc = model.model.sparse_arch.embedding_bag_collection
    kinds, sizes = table_kinds(cfg.sharding), dict(zip(CATEGORICAL, table_sizes(cfg.model)))
    if "auto" not in kinds.values():
        load, gens = [0] * info.world_size, {}
        for name in sorted(CATEGORICAL, key=lambda n: -sizes[n]):
            if kinds[name] == "table_wise":
                rank = load.index(min(load))
                load[rank] += sizes[name]
                gens[name] = table_wise(rank=rank)
            else:
                gens[name] = {
                    "row_wise": row_wise,
                    "data_parallel": data_parallel,
                    "column_wise": lambda: column_wise(ranks=list(range(info.world_size))),
                }[kinds[name]]()
        module_plan = construct_module_sharding_plan(
            ebc, {n: gens[n] for n in CATEGORICAL}, world_size=info.world_size, device_type=info.device.type
        )
        return ShardingPlan({"model.sparse_arch.embedding_bag_collection": module_plan})
    local = int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size))
    topology = Topology(world_size=info.world_size, local_world_size=local, compute_device=info.device.type)
    constraints = {n: ParameterConstraints(sharding_types=[k]) for n, k in kinds.items() if k != "auto"}
    return EmbeddingShardingPlanner(topology=topology, constraints=constraints).collective_plan(
        model, pg=dist.group.WORLD
    )


def shard_model(cfg: Config, info: cookbook.DistInfo) -> tuple[DistributedModelParallel, CombinedOptimizer]:
    """DistributedModelParallel over the DLRM and one optimizer over all of it."""
    model = build_model(cfg, info.device)
    sparse_cls, sparse_kw = sparse_optimizer(cfg.optim)
    # Registered before sharding: DMP fuses this optimizer into the sharded tables' backward (FBGEMM).
    apply_optimizer_in_backward(sparse_cls, model.model.sparse_arch.parameters(), dict(sparse_kw))  # it adds keys
    plan = sharding_plan(cfg, model, info)
    dmp = DistributedModelParallel(model, device=info.device, plan=plan)
    rest = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    dp_tables = {k: v for k, v in rest.items() if ".embedding_bags." in k}  # data-parallel tables: replicated
    dense = {k: v for k, v in rest.items() if k not in dp_tables}
    dense_cls = torch.optim.Adagrad if cfg.optim.dense == "adagrad" else torch.optim.SGD
    dense_kw = {"lr": cfg.optim.dense_lr, **({"eps": cfg.optim.eps} if cfg.optim.dense == "adagrad" else {})}
    optimizers = [
        ("fused", dmp.fused_optimizer),
        ("dense", KeyedOptimizerWrapper(dense, lambda p: dense_cls(p, **dense_kw))),
    ]
    if dp_tables:
        optimizers.append(("dp_tables", KeyedOptimizerWrapper(dp_tables, lambda p: sparse_cls(p, **sparse_kw))))
    return dmp, CombinedOptimizer(optimizers)


class DLRMState:
    """DCP `Stateful` for the sharded model and its optimizers: table shards and their fused optimizer state
    are ShardedTensors (each rank writes its own), dense weights and Adagrad sums are replicated (written once)."""

    def __init__(self, model: DistributedModelParallel, optimizer: CombinedOptimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])


class IntsAsTensors:
    """DCP `Stateful` adapter that stores a state of plain ints (step, data position) as 0-d tensors. Beside
    TorchRec's ShardedTensors, torch 2.13's DCP load keeps a dict of plain ints whole while save stored its
    entries one by one, and the resume fails with "Missing key in checkpoint state_dict"."""

    def __init__(self, obj):
        self.obj = obj

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: torch.tensor(v) for k, v in self.obj.state_dict().items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.obj.load_state_dict({k: int(v) for k, v in state.items()})


def describe_plan(model: DistributedModelParallel) -> str:
    """``table_wise: 20 tables, row_wise: 6 tables`` from the plan DMP applied."""
    counts = Counter(ps.sharding_type for module_plan in model.plan.plan.values() for ps in module_plan.values())  # type: ignore[union-attr]
    return ", ".join(f"{k}: {v} tables" for k, v in sorted(counts.items()))


@torch.no_grad()
def evaluate(model: DistributedModelParallel, batches: list[Batch], device: torch.device) -> dict[str, float]:
    """AUC and log-loss over the validation rows of every rank (padding rows excluded)."""
    model.eval()
    auroc = BinaryAUROC().to(device)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    count = torch.zeros((), dtype=torch.float64, device=device)
    for batch in batches:
        keep = batch.weights.to(device) > 0  # type: ignore[attr-defined]
        _, (_, logits, labels) = model(batch.to(device))
        logits, labels = logits.float()[keep], labels.float()[keep]
        loss_sum += torch.nn.functional.binary_cross_entropy_with_logits(logits, labels, reduction="sum").double()
        count += keep.sum()
        auroc.update(torch.sigmoid(logits), labels.long())
    totals = cookbook.all_reduce_sum({"loss": loss_sum, "rows": count}, device)
    auc = float(auroc.compute())  # gathers every rank's predictions
    model.train()
    return {"auc": auc, "logloss": totals["loss"] / max(totals["rows"], 1.0), "rows": totals["rows"]}


# ----------------------------------------------------------------------------- recipe
def preflight(cfg: Config, world_size: int) -> str:
    """What ``--check`` runs in one process before torchrun starts any worker (launch.sh); returns what the data holds."""
    check_sharding(cfg, world_size, on_cpu=cookbook.get_dist_info().device.type == "cpu")
    if cfg.data.hub_id and cfg.data.train_files == [str(hub_file(cfg))]:  # None: written before, for these settings
        n = text_files.dataset_to_text(
            cfg.data.hub_id,
            cfg.data.hub_split,
            hub_file(cfg),
            criteo_line,
            COLUMNS,
            cfg.data.hub_max_rows,
            version=HUB_FORMAT,
        )
        if n is not None:
            print(f"{cfg.data.hub_id} ({cfg.data.hub_split}): {n} rows written to {hub_file(cfg)}")
    data = check_data(cfg, world_size)  # before the resume: a bad row is named on a used output_dir too
    Checkpointer(Path(cfg.output_dir) / "checkpoints", cannot_remap=CANNOT_REMAP).check_resume(
        cfg.checkpoint.resume, world_size, to_dict(cfg), MAY_CHANGE, cfg.train.stop_at_step
    )
    return data


def load(path: str, overrides: list[str]) -> Config:
    cfg = load_config(Config, path, overrides)
    check_config(cfg, Path(path).resolve().parent)
    return cfg


@cookbook.cli(load, preflight)  # --check: preflight
def main(cfg: Config) -> None:
    # ---- set-up
    on_cpu = cookbook.get_dist_info().device.type == "cpu"  # COOKBOOK_DEVICE=cpu, or no GPU
    info = cookbook.init_distributed(cfg.train.collective_timeout_s, debug_dir=Path(cfg.output_dir) / "debug")
    check_sharding(cfg, info.world_size, on_cpu)
    model, optimizer = shard_model(cfg, info)
    stream = CriteoStream(cfg, info.rank, info.world_size)
    evals = eval_batches(cfg, info.rank, info.world_size)
    state = TrainState()
    max_steps = cfg.train.max_steps if cfg.train.max_steps > 0 else cfg.train.epochs * len(stream)
    with Run(
        cfg,
        info,
        state=state,
        checkpoint={"app": DLRMState(model, optimizer), "train": IntsAsTensors(state), "data": IntsAsTensors(stream)},
        may_change=MAY_CHANGE,
        max_steps=max_steps,
        experiment="torchrec-dlrm",
        count_tokens=False,
        cannot_remap=CANNOT_REMAP,
        evaluate=(lambda: evaluate(model, evals, info.device)) if evals else None,
    ) as run:
        n_rows = sum(table_sizes(cfg.model))
        run.say(
            f"world size {info.world_size} ({info.backend}) | {describe_plan(model)} | 26 tables, {n_rows:,} rows x "
            f"{cfg.model.embedding_dim} ({n_rows * cfg.model.embedding_dim * 4 / 2**30:.2f} GiB fp32) | global batch "
            f"{cfg.train.batch_size * info.world_size} | {max_steps} steps | optimizers: {cfg.optim.sparse} (tables), "
            f"{cfg.optim.dense} (dense)"
        )

        # ---- train loop
        batches, pipeline = stream.timed(), None
        if cfg.train.pipeline and info.device.type == "cuda":
            from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

            pipeline = TrainPipelineSparseDist(model, optimizer, info.device)
        for _ in run.steps():
            if (
                pipeline is not None
            ):  # forward, backward and optimizer step, with the next batch's input dist overlapped
                loss, _ = pipeline.progress(batches)
                run.skip_step(loss=loss, applied=True)  # checked before the next log or save: NaN stops the run
            else:
                loss, _ = model(next(batches).to(info.device))
                if run.skip_step(loss=loss):  # NaN / inf on any rank, before backward (where the tables update)
                    stream.finished()  # train.on_nonfinite=skip: this batch is passed over
                    continue
                loss.backward()  # the sharded tables update here (fused optimizer)
                optimizer.step()  # the dense part and data-parallel tables
                optimizer.zero_grad(set_to_none=True)
            wait = stream.finished()  # the batch this step finished (the pipeline reads one ahead) is the data position
            state.epoch = stream.epoch
            run.metrics.add(samples=cfg.train.batch_size, tokens=0, data_wait_s=wait)
            run.end_step(loss, lr=cfg.optim.dense_lr)

        # ---- finish
        run.finish()

    # ---- clean-up
    cookbook.destroy_distributed()


if __name__ == "__main__":
    cookbook.run_main(main, user_errors=(ConfigError, DataError, CheckpointError))
