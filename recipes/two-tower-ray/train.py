"""Train a two-tower retrieval model (user tower, item tower) on interaction data with Ray Train DDP.

Commands (from this folder):

    ./launch.sh data.interactions=/data/interactions.parquet      # all GPUs of this node (or 2 CPU workers)
    CONFIG_FILE=tiny.yaml ./launch.sh                             # generated interactions, CPU, offline
    NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 ./launch.sh         # on each node, with its NODE_RANK
    RAY_ADDRESS=10.0.0.1:6379 ./launch.sh                         # an existing Ray cluster

Towers: id embedding, 2-layer MLP, L2 normalisation; loss: in-batch sampled softmax with log-q correction
(Yi et al. 2019); evaluation: recall@k over the whole catalogue beside popularity. ``train_loop`` runs on every
Ray worker, ``main`` is the driver. What it supports (formats, resume, preemption): README.md beside this file.
"""

from __future__ import annotations

import contextlib
import math
import re
import warnings
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

warnings.filterwarnings("ignore", message=".*set_vital.*")

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset

import cookbook
from cookbook import ray_train, tabular
from cookbook.checkpoint import CheckpointError
from cookbook.config import ConfigError, check_fields, load_config
from cookbook.hub import resolve_path
from cookbook.errors import not_a_file
from cookbook.tabular import DataError


# ----------------------------------------------------------------------------- config
@dataclass
class ModelConfig:
    embedding_dim: int = 128  # id embedding width
    hidden_dim: int = 256
    output_dim: int = 64  # tower output (the retrieval space)
    temperature: float = 0.05


@dataclass
class DataConfig:
    interactions: str = ""  # file with user_id, item_id[, timestamp] (see README: Data)
    user_column: str = "user_id"
    item_column: str = "item_id"
    time_column: str = "timestamp"  # optional; when absent, file order is time order
    min_user_interactions: int = 2  # users with fewer have nothing to hold out and only train


@dataclass
class OptimConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0


@dataclass
class TrainConfig(ray_train.EpochTrainConfig):  # on_nonfinite, max_consecutive_skips: cookbook.ray_train's
    seed: int = 42
    micro_batch_size: int = 1024  # positives per worker per step; each is scored against the batch's other items
    epochs: int = 10
    stop_at_epoch: int = -1  # > 0: stop after this epoch's checkpoint; re-run to continue
    mixed_precision: str = "fp32"  # bf16: the towers under bf16 autocast on GPU (the loss in fp32); fp32
    log_every: int = 50
    recall_k: list[int] = field(default_factory=lambda: [10, 50])
    logq_correction: bool = True


@dataclass
class Config(ray_train.EpochRunConfig):  # output_dir, run_name, mlflow, ray, checkpoint: cookbook.ray_train's
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


# Settings that may differ between a checkpoint and the run that resumes it; any other change is refused.
MAY_CHANGE = ray_train.EPOCH_MAY_CHANGE


def check_config(cfg: Config, config_dir: Path) -> None:
    """Resolve paths against the config file's folder and reject incompatible values."""
    cfg.data.interactions = resolve_path(cfg.data.interactions, config_dir)
    cfg.output_dir = str(Path(cfg.output_dir).expanduser().resolve())
    if not cfg.data.interactions:
        raise ConfigError("data.interactions is not set: give the interaction file (see the README's Data section)")
    check_fields(
        cfg,
        at_least={"train.micro_batch_size": 2, "train.epochs": 1, "train.log_every": 1, "model.output_dim": 1},
        one_of={"train.mixed_precision": ("bf16", "fp32")},
        within={"optim.lr": "(0, inf)", "optim.weight_decay": "[0, inf)"},
        notes={"train.micro_batch_size": "the other items of the batch are the negatives"},
    )
    if not cfg.train.recall_k or min(cfg.train.recall_k) < 1:
        raise ConfigError(f"train.recall_k must be a non-empty list of positive integers, got {cfg.train.recall_k}")


# ----------------------------------------------------------------------------- data
@dataclass
class Interactions:
    """Integer-coded interactions: training pairs, one held-out item per evaluated user, and the
    training frequency of each item (for log-q correction and the popularity baseline)."""

    train_users: np.ndarray
    train_items: np.ndarray
    eval_users: np.ndarray
    eval_items: np.ndarray
    num_users: int
    num_items: int
    item_counts: np.ndarray


ID_WRITTEN_AS_DECIMAL = re.compile(
    r"([+-]?\d+)\.0*"
)  # "12.0": an integer id as spreadsheets and float columns write it


def _id(value, column: str, where: str) -> str:
    """An id as text, stripped of spaces; ``12.0`` is ``12``. Raises DataError for a missing or empty one."""
    text = "" if value is None or (isinstance(value, float) and math.isnan(value)) else str(value).strip()
    if not text:
        raise DataError(f"{where}: missing or empty {column}")
    decimal = ID_WRITTEN_AS_DECIMAL.fullmatch(text)
    return decimal.group(1) if decimal else text


def _time(value, column: str, where: str) -> float:
    """A timestamp as a number (a parquet timestamp as seconds since 1970, UTC when it has no zone)."""
    if isinstance(value, datetime):
        return (value if value.tzinfo else value.replace(tzinfo=timezone.utc)).timestamp()
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number) or isinstance(value, bool):  # "1e999" is inf: no order of events
        raise DataError(f"{where}: {column} {value!r} is not a {'finite ' if not math.isnan(number) else ''}number")
    return number


def read_interactions(cfg: DataConfig) -> Interactions:
    """Read (`cookbook.tabular`: CSV, TSV, JSON / JSONL, parquet), validate, encode and split the
    interaction file (leave-last-out per user).

    Ids are text, stripped of surrounding spaces; an integer written as a decimal (``12.0``) is
    the id ``12``. The file is read once, row by row; only the id and time columns are kept.

    Raises:
        DataError: the file is missing, unreadable (see `cookbook.tabular.records`) or empty, a column is
            missing, an id is missing or empty or a timestamp is not a number (the line is named),
            or no user has enough interactions to hold one out.
    """
    path = Path(cfg.interactions)
    if not path.is_file():
        raise DataError(f"data.interactions: {not_a_file(path)}")
    id_columns = [cfg.user_column, cfg.item_column]
    found = tabular.column_names(path)  # None for JSON: each row names its own
    if found == []:
        raise DataError(f"{path}: empty file")
    missing = [c for c in id_columns if found is not None and c not in found]
    if missing:
        separator = next(
            (
                name
                for sep, name in ((";", "semicolon"), ("\t", "tab"), (",", "comma"))
                if len(found) == 1 and sep in found[0]
            ),
            None,
        )
        hint = (
            f"the header looks {separator}-separated; .csv files are split on commas, .tsv files on tabs"
            if separator
            else "the first line must be a header naming the columns; or set data.user_column / data.item_column"
        )
        raise DataError(f"{path}: missing column(s) {missing}; found {found} ({hint})")
    timed = None if found is None else cfg.time_column in found  # JSON: the first row decides
    first_keys, users, items, times = found, [], [], []
    for where, row in tabular.records(path, required=id_columns + [c for c in [cfg.time_column] if found and timed]):
        if timed is None:
            timed, first_keys = cfg.time_column in row, list(row)
        users.append(_id(row[cfg.user_column], cfg.user_column, where))
        items.append(_id(row[cfg.item_column], cfg.item_column, where))
        if timed:
            times.append(_time(row.get(cfg.time_column), cfg.time_column, where))
        elif cfg.time_column in row:
            raise DataError(f"{where}: a {cfg.time_column}, but the first row has none (give every row one, or none)")
    if not users:
        raise DataError(f"{path}: no rows")
    if not timed and cfg.time_column != DataConfig.time_column:
        raise DataError(
            f"{path}: data.time_column={cfg.time_column!r} is not a column; found {first_keys} "
            f"(leave it at {DataConfig.time_column!r} when the file has no time column)"
        )
    df = pd.DataFrame({cfg.user_column: users, cfg.item_column: items})
    del users, items
    order = np.arange(len(df))
    if timed:
        order = np.lexsort((order, np.asarray(times, dtype=np.float64)))  # stable: ties keep file order
    df = df.iloc[order]
    users, user_ids = pd.factorize(df[cfg.user_column], sort=True)
    items, item_ids = pd.factorize(df[cfg.item_column], sort=True)
    counts = np.bincount(users, minlength=len(user_ids))
    # The last interaction of each user with enough history is held out.
    last = np.zeros(len(df), dtype=bool)
    last_pos = pd.Series(np.arange(len(df))).groupby(users).max().to_numpy()
    eligible = counts[np.arange(len(user_ids))] >= max(cfg.min_user_interactions, 2)
    last[last_pos[eligible]] = True
    if not last.any():
        raise DataError(
            f"{path}: no user has {max(cfg.min_user_interactions, 2)} or more interactions, so none can be "
            f"held out for recall@k"
        )
    train_items = items[~last]
    return Interactions(
        users[~last],
        train_items,
        users[last],
        items[last],
        len(user_ids),
        len(item_ids),
        np.bincount(train_items, minlength=len(item_ids)),
    )


# ----------------------------------------------------------------------------- model and loss
class Tower(torch.nn.Module):
    """Id embedding -> Linear -> ReLU -> Linear -> L2 normalisation."""

    def __init__(self, num_ids: int, cfg: ModelConfig):
        super().__init__()
        self.embedding = torch.nn.Embedding(num_ids, cfg.embedding_dim)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(cfg.embedding_dim, cfg.hidden_dim),
            torch.nn.ReLU(),
            torch.nn.Linear(cfg.hidden_dim, cfg.output_dim),
        )
        torch.nn.init.normal_(self.embedding.weight, std=0.1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.mlp(self.embedding(ids)), dim=-1)


class TwoTower(torch.nn.Module):
    """A user tower and an item tower; ``forward(users, items)`` embeds both."""

    def __init__(self, num_users: int, num_items: int, cfg: ModelConfig):
        super().__init__()
        self.user_tower, self.item_tower = Tower(num_users, cfg), Tower(num_items, cfg)

    def forward(self, users: torch.Tensor, items: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.user_tower(users), self.item_tower(items)


def sampled_softmax_loss(
    user_emb: torch.Tensor, item_emb: torch.Tensor, items: torch.Tensor, log_q: torch.Tensor | None, temperature: float
) -> torch.Tensor:
    """In-batch sampled softmax: row i's positive is item i, the batch's other items are negatives.

    Args:
        user_emb, item_emb: (B, D) normalised embeddings of the batch's pairs.
        items: (B,) item indices, to mask other occurrences of row i's own item (not negatives).
        log_q: (B,) log sampling probability of each item (its training frequency); subtracted from
            the logits so popular items are not over-penalised as negatives. ``None``: no correction.
        temperature: logits are cosine / temperature.
    """
    logits = user_emb @ item_emb.T / temperature
    if log_q is not None:
        logits = logits - log_q[None, :]
    same = items[:, None] == items[None, :]
    same.fill_diagonal_(False)
    logits = logits.masked_fill(same, float("-inf"))
    return F.cross_entropy(logits, torch.arange(len(items), device=logits.device))


@torch.no_grad()
def recall_at_k(
    model: TwoTower,
    data: Interactions,
    ks: list[int],
    rank: int,
    world_size: int,
    device: torch.device,
    chunk: int = 1024,
) -> dict[str, float]:
    """recall@k of the held-out item over the whole catalogue, and the popularity baseline's.

    For each held-out user, every item is scored and the user's training items are excluded,
    except the held-out item itself (a repeat of an item seen in training is still a hit when
    ranked in the top k); recall@k is the fraction of users whose held-out item is in the top k.
    Worker `rank` of `world_size` scores the users ``eval_users[rank::world_size]`` (disjoint,
    possibly none; no padding), and hit and user counts are summed across workers
    (``cookbook.all_reduce_sum``, the one collective), so each user counts once whatever the split.

    Args:
        model: the unwrapped `TwoTower` (not DDP); no collective runs in its forward.
        ks: cut-offs; k above the catalogue size counts every item.

    Returns:
        ``recall_at_<k>`` and ``popularity_recall_at_<k>`` for each k (0 without users), and ``users``.
    """
    model.eval()
    all_items = model.item_tower(torch.arange(data.num_items, device=device))
    row_of = np.full(data.num_users, -1)
    popular = torch.as_tensor(data.item_counts, dtype=torch.float32, device=device)
    kmax = min(max(ks), data.num_items)
    hits = {f"recall_at_{k}": torch.zeros((), dtype=torch.float64, device=device) for k in ks}
    hits.update({f"popularity_recall_at_{k}": torch.zeros((), dtype=torch.float64, device=device) for k in ks})
    users, targets = data.eval_users[rank::world_size], data.eval_items[rank::world_size]
    for start in range(0, len(users), chunk):
        u = torch.as_tensor(users[start : start + chunk], device=device)
        t = torch.as_tensor(targets[start : start + chunk], device=device)
        row_of[users[start : start + chunk]] = np.arange(len(u))
        sel = row_of[data.train_users] >= 0  # the training pairs of this chunk's users
        mask = np.zeros((len(u), data.num_items), dtype=bool)
        mask[row_of[data.train_users[sel]], data.train_items[sel]] = True
        mask[np.arange(len(u)), targets[start : start + chunk]] = False  # the held-out item is always ranked
        mask = torch.as_tensor(mask, device=device)
        row_of[users[start : start + chunk]] = -1
        for name, scores in (("", model.user_tower(u) @ all_items.T), ("popularity_", popular.expand(len(u), -1))):
            top = scores.masked_fill(mask, float("-inf")).topk(kmax, dim=-1).indices
            for k in ks:
                hits[f"{name}recall_at_{k}"] += (top[:, :k] == t[:, None]).any(-1).sum()
    totals = cookbook.all_reduce_sum({**hits, "users": torch.tensor(float(len(users)), device=device)}, device)
    model.train()
    users_total = totals.pop("users")
    return {**{k: v / max(users_total, 1.0) for k, v in totals.items()}, "users": users_total}


# ----------------------------------------------------------------------------- worker
def train_loop(config_dict: dict) -> None:
    """What every Ray Train worker runs: set-up, epochs with a checkpoint each, summary."""
    import ray.train.torch

    cfg: Config = ray_train.config_from_dict(Config, config_dict)
    info = ray_train.worker_info()
    torch.manual_seed(cfg.train.seed)
    bf16 = info.device.type == "cuda" and cfg.train.mixed_precision == "bf16"

    # ---- set-up: data, model (DDP), optimizer, resume
    data = read_interactions(cfg.data)
    pairs = TensorDataset(torch.as_tensor(data.train_users), torch.as_tensor(data.train_items))
    # One index gather per micro-batch (the sampler yields index lists, batch_size=None): a per-row __getitem__ and
    # collate of 4,096 (user, item) pairs took longer than the step on a GPU. The DistributedSampler shards the rows
    # over the workers (and shuffles by seed and epoch with one); Ray only moves the batches to the device.
    sampler = DistributedSampler(
        pairs, num_replicas=info.world_size, rank=info.rank, shuffle=True, seed=cfg.train.seed, drop_last=True
    )
    loader = ray.train.torch.prepare_data_loader(
        DataLoader(pairs, sampler=BatchSampler(sampler, cfg.train.micro_batch_size, drop_last=True), batch_size=None),
        add_dist_sampler=False,
    )
    if len(loader) == 0:
        raise DataError(
            f"{len(pairs)} training interactions are too few for one step of "
            f"{cfg.train.micro_batch_size} x {info.world_size} workers"
        )
    log_q = torch.log(
        torch.as_tensor(
            np.maximum(data.item_counts, 1) / data.item_counts.sum(), dtype=torch.float32, device=info.device
        )
    )
    inner = TwoTower(data.num_users, data.num_items, cfg.model).to(info.device)
    model = ray.train.torch.prepare_model(inner)  # DDP
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    run = ray_train.WorkerRun(
        cfg,
        info,
        "two-tower-ray",
        {"model": inner, "optimizer": optimizer},
        max_steps=cfg.train.epochs * len(loader),
        steps_per_epoch=len(loader),
        stop_at=("train.stop_at_epoch", cfg.train.stop_at_epoch),
        count_tokens=False,
        about=f"{data.num_users:,} users, {data.num_items:,} items | {len(pairs):,} train interactions, "
        f"{len(data.eval_users):,} held-out users | {sum(p.numel() for p in inner.parameters()) / 1e6:.2f} M params | "
        f"global batch {cfg.train.micro_batch_size * info.world_size} | {'bf16 autocast' if bf16 else 'fp32'} | "
        f"log-q correction {'on' if cfg.train.logq_correction else 'off'}",
    )

    # ---- train loop: one checkpoint per epoch
    with run:
        for epoch in run.epochs():
            sampler.set_epoch(epoch)
            for (users, items), wait in run.timed(loader):
                with torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
                    user_emb, item_emb = model(users, items)
                loss = sampled_softmax_loss(
                    user_emb.float(),
                    item_emb.float(),
                    items,
                    log_q[items] if cfg.train.logq_correction else None,
                    cfg.model.temperature,
                )
                loss.backward()
                run.metrics.add(samples=len(users), tokens=0, data_wait_s=wait)
                # DDP all-reduced the gradients: the norm is the same on every worker (a NaN on one is a NaN on all)
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))  # measured, not clipped
                if run.skip_step(
                    grad_norm
                ):  # NaN / inf: the run stops, or (train.on_nonfinite=skip) the batch is dropped
                    optimizer.zero_grad(set_to_none=True)
                    continue
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                run.end_step(loss, lr=cfg.optim.lr, grad_norm=grad_norm)
            run.end_epoch(lambda: recall_at_k(inner, data, cfg.train.recall_k, info.rank, info.world_size, info.device))
            with run.checkpoint() as saved:  # state.pt + meta.json on rank 0 (also mid-epoch, after a stop request)
                ray.train.report(**saved)  # every worker; Ray registers checkpoint_epoch_<n> once all have reported

        # ---- summary (Ray Train destroys the process group)
        run.finish(inner)


# ----------------------------------------------------------------------------- driver
def load(path: str, overrides: list[str]) -> Config:
    cfg = load_config(Config, path, overrides)
    check_config(cfg, Path(path).resolve().parent)
    return cfg


def preflight(cfg: Config, world_size: None) -> str:
    """``--check``: the driver's checks (the driver plans the workers: no world size)."""
    return driver_checks(cfg)[1]


def driver_checks(cfg: Config) -> tuple[ray_train.RayDriver, str]:
    """The driver's checks before Ray starts (``--check`` runs them alone), the data's before the resume's; returns
    the driver and what the data holds."""
    data = read_interactions(cfg.data)  # bad rows are named before Ray starts
    driver = ray_train.RayDriver(cfg, ("train.stop_at_epoch", cfg.train.stop_at_epoch))  # the workers planned here
    if driver.workers and len(data.train_users) < cfg.train.micro_batch_size * driver.workers:
        raise ConfigError(
            f"{len(data.train_users)} training interactions are too few for one step of "
            f"{cfg.train.micro_batch_size} x {driver.workers} workers"
        )
    return driver.check_resume(MAY_CHANGE), (
        f"{data.num_users} users, {data.num_items} items, {len(data.train_users)} train interactions, "
        f"{len(data.eval_users)} held out"
    )


@cookbook.cli(load, preflight, sized=False)  # --check: preflight
def main(cfg: Config) -> None:
    driver, _ = driver_checks(cfg)
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    # Already complete: said, exit 0. Else Ray started or joined, the workers sized; SIGTERM / SIGUSR1: a stop request.
    with driver.started(cfg.train.epochs):
        trainer = TorchTrainer(
            **driver.worker_loop(__file__),  # each worker imports this file and runs its train_loop(config)
            scaling_config=ScalingConfig(**driver.scaling),  # ray.num_workers DDP processes, one per GPU on GPUs
            run_config=RunConfig(**driver.run_options),  # output_dir, checkpoint.keep_last, ray.max_failures
        )
        driver.finish(trainer.fit())


if __name__ == "__main__":
    cookbook.run_main(main, user_errors=(ConfigError, DataError, CheckpointError))
