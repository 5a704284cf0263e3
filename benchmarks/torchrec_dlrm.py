"""Records/s per rank of the TorchRec DLRM recipe for each sharding kind, against plain data parallelism.

Every variant is the recipe's own model (``build_model``: DLRM with 26 tables, dot interaction) and optimizers
(row-wise Adagrad for the tables, Adagrad for the MLPs), trained on the same synthetic batches (uniform ids,
already in memory: no text parsing) for ``--steps`` steps after ``--warmup``:

- ``table_wise``, ``row_wise``, ``column_wise``, ``data_parallel``, ``auto``: the recipe's ``shard_model``
  (TorchRec ``DistributedModelParallel``, FBGEMM kernels, fused table optimizer), every table of that kind;
  ``auto`` is TorchRec's planner.
- ``ddp_embeddingbag``: the same DLRM with an unsharded ``EmbeddingBagCollection`` (one ``nn.EmbeddingBag``
  per table, dense gradients) wrapped in ``DistributedDataParallel``: every rank holds every table and
  all-reduces every table's full gradient each step.

    torchrun --standalone --nproc-per-node 2 benchmarks/torchrec_dlrm.py                 # CPU: 2 gloo ranks
    torchrun --standalone --nproc-per-node 8 benchmarks/torchrec_dlrm.py --rows 1000000 --dim 128 --batch 8192

Prints one JSON line per variant and a Markdown table (rank 0).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "torchrec-dlrm"
KINDS = ("table_wise", "row_wise", "column_wise", "data_parallel", "auto")


def recipe():
    sys.path.insert(0, str(RECIPE))  # train.py imports the modules beside it (text_files)
    spec = importlib.util.spec_from_file_location("torchrec_dlrm_train", RECIPE / "train.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def synthetic_batches(train, cfg, n: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    sizes, B = train.table_sizes(cfg.model), cfg.train.batch_size
    out = []
    for _ in range(n):
        labels = rng.integers(0, 2, size=B).astype(float)
        dense = np.log1p(rng.poisson(5, size=(B, 13))).tolist()
        ids = np.stack([rng.integers(0, s, size=B) for s in sizes], axis=1).tolist()
        out.append(train.to_batch(list(zip(labels.tolist(), dense, ids))))
    return out


def ddp_embeddingbag(train, cfg, info):
    """The recipe's DLRM with real (unsharded) nn.EmbeddingBag tables under DDP, same optimizers."""
    from torch.nn.parallel import DistributedDataParallel
    from torchrec import EmbeddingBagCollection

    model = train.build_model(cfg, info.device)
    ebc = model.model.sparse_arch.embedding_bag_collection
    model.model.sparse_arch.embedding_bag_collection = EmbeddingBagCollection(
        tables=ebc.embedding_bag_configs(), device=info.device
    )
    ddp = DistributedDataParallel(model, device_ids=[info.device] if info.device.type == "cuda" else None)
    tables = [p for n, p in model.named_parameters() if ".embedding_bags." in n]
    dense = [p for n, p in model.named_parameters() if ".embedding_bags." not in n]
    sparse_cls, sparse_kw = train.sparse_optimizer(cfg.optim)
    optimizers = [sparse_cls(tables, **sparse_kw), torch.optim.Adagrad(dense, lr=cfg.optim.dense_lr, eps=cfg.optim.eps)]

    class Both:
        def step(self):
            for o in optimizers:
                o.step()

        def zero_grad(self, set_to_none=True):
            for o in optimizers:
                o.zero_grad(set_to_none=set_to_none)

    return ddp, Both()


def measure(model, optimizer, batches, device, warmup: int, steps: int) -> float:
    """Seconds per step over `steps` steps after `warmup`."""
    for i in range(warmup + steps):
        if i == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize()
            torch.distributed.barrier()
            t0 = time.perf_counter()
        loss, _ = model(batches[i % len(batches)].to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    torch.distributed.barrier()
    return (time.perf_counter() - t0) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000, help="rows per table (26 tables)")
    parser.add_argument("--dim", type=int, default=64, help="embedding dimension")
    parser.add_argument("--batch", type=int, default=2048, help="records per rank per step")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--variants", default=",".join([*KINDS, "ddp_embeddingbag"]))
    args = parser.parse_args()

    import cookbook

    train = recipe()
    info = cookbook.init_distributed()
    cfg = train.load_config(
        train.Config,
        RECIPE / "config.yaml",
        [
            f"model.table_sizes=[{args.rows}]",
            f"model.embedding_dim={args.dim}",
            f"model.dense_arch=[512,256,{args.dim}]",
            f"train.batch_size={args.batch}",
        ],
    )
    batches = synthetic_batches(train, cfg, 4, seed=info.rank)
    gib = 26 * args.rows * args.dim * 4 / 2**30
    results = []
    for variant in args.variants.split(","):
        if variant == "ddp_embeddingbag":
            model, optimizer = ddp_embeddingbag(train, cfg, info)
        else:
            cfg.sharding.plan = variant  # auto: on CPU the planner picks among table-, column-wise and data parallel
            model, optimizer = train.shard_model(cfg, info)
        step_s = measure(model, optimizer, batches, info.device, args.warmup, args.steps)
        plan = train.describe_plan(model) if variant != "ddp_embeddingbag" else "DDP, full replicas"
        rss = torch.tensor(__import__("psutil").Process().memory_info().rss / 2**30)
        torch.distributed.all_reduce(rss, op=torch.distributed.ReduceOp.MAX)
        rec = {
            "variant": variant,
            "plan": plan,
            "world_size": info.world_size,
            "device": info.device.type,
            "batch_per_rank": args.batch,
            "step_ms": round(step_s * 1000, 1),
            "records_per_s_per_rank": round(args.batch / step_s, 1),
            "max_rss_gib": round(rss.item(), 2),
            "tables_gib_fp32": round(gib, 2),
        }
        results.append(rec)
        if info.is_main:
            print(json.dumps(rec), flush=True)
        del model, optimizer
    if info.is_main:
        base = next((r["records_per_s_per_rank"] for r in results if r["variant"] == "ddp_embeddingbag"), None)
        print(
            f"\n26 tables x {args.rows:,} rows x {args.dim} ({gib:.2f} GiB fp32), batch {args.batch} per rank, "
            f"{info.world_size} ranks ({info.device.type}), {args.steps} steps after {args.warmup}\n"
        )
        print("| variant | plan | step_ms | records/s/rank | vs DDP nn.EmbeddingBag | max RSS GiB |")
        print("|---|---|---|---|---|---|")
        for r in results:
            ratio = f"{r['records_per_s_per_rank'] / base:.2f}x" if base else ""
            print(
                f"| {r['variant']} | {r['plan']} | {r['step_ms']} | {r['records_per_s_per_rank']:,.0f} | {ratio} | "
                f"{r['max_rss_gib']} |"
            )
    cookbook.destroy_distributed()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
