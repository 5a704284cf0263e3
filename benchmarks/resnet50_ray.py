"""ResNet-50 throughput, images/s per GPU, for recipes/resnet50-ray-ddp.

Three measurements, so that the bottleneck is visible:

- ``synthetic``: the recipe's own ``train_step`` (bf16 autocast, channels-last, SGD, DDP) on uint8
  images already on the GPU: the compute ceiling, no data pipeline. Runs under torchrun, no Ray
  needed (Ray's 79 MB wheel may not travel to the GPU machine).
- ``loader``: the recipe's own training data pipeline (``ImageDataset`` + ``ImageTransform`` in a
  ``DataLoader``: JPEG decode, random resized crop, flip, uint8 batches) on the host's CPUs with no
  model, no GPU and no Ray: the pipeline's ceiling, for several loader-process counts.
- ``real``: the full recipe (Ray Train, JPEG decoding in data-loader workers) on an ImageFolder;
  read images/s per GPU from its metrics.jsonl. Needs Ray installed.

    # compute ceiling, 1 and 2 GPUs (prints one JSON line each)
    torchrun --nproc-per-node 1 benchmarks/resnet50_ray.py synthetic --steps 100 --batch 256
    torchrun --nproc-per-node 2 benchmarks/resnet50_ray.py synthetic --steps 100 --batch 256
    # data pipeline ceiling on this host's CPUs, 14 and 28 loader processes (one JSON line each)
    python benchmarks/resnet50_ray.py loader --data /data/hymenoptera_data/train --repeat 200 --loader-workers 14 28
    # real images through the recipe (see benchmarks/README.md for the data); --repeat 200 links each
    # JPEG 200 times under new names, so that epochs are long enough for a steady state
    python benchmarks/resnet50_ray.py real --data /data/hymenoptera_data/train --repeat 200 --gpus 1 --epochs 2
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "resnet50-ray-ddp"


def recipe():
    spec = importlib.util.spec_from_file_location("resnet50_ray_train", RECIPE / "train.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def synthetic(args: argparse.Namespace) -> None:
    """Time `train_step` on random uint8 images resident on the GPU; rank 0 prints one JSON record."""
    import cookbook

    train = recipe()
    info = cookbook.init_distributed()
    torch.manual_seed(0)
    model = train.build_model(train.ModelConfig(backend=args.backend, pretrained=False), 1000).to(info.device)
    on_gpu = info.device.type == "cuda"
    if on_gpu:
        model = model.to(memory_format=torch.channels_last)
    if args.compile:
        model.compile()
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[info.local_rank] if on_gpu else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    images = torch.randint(0, 256, (args.batch, 3, args.size, args.size), dtype=torch.uint8, device=info.device)
    labels = torch.randint(0, 1000, (args.batch,), device=info.device)
    times = []
    for i in range(args.warmup + args.steps):
        if on_gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        train.train_step(ddp, opt, images, labels, bf16=on_gpu, channels_last=on_gpu)
        if on_gpu:
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    times.sort()
    median = times[len(times) // 2]
    if info.is_main:
        print(json.dumps({"mode": "synthetic", "gpus": info.world_size, "device": torch.cuda.get_device_name() if on_gpu else "cpu",
                          "backend": type(model).__module__.split(".")[0], "batch_per_gpu": args.batch, "compile": args.compile,
                          "median_step_s": median, "images_per_s_per_gpu": args.batch / median,
                          "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None,
                          "torch": torch.__version__}))
    cookbook.destroy_distributed()


def repeated_image_folder(src: Path, dest: Path, repeat: int) -> Path:
    """An ImageFolder at `dest` whose class folders hold every image of `src` `repeat` times, as hard links
    (copies where links fail) named ``<stem>_<i><suffix>``. Decoding cost per image is unchanged; the
    epoch is `repeat` times longer. Returns `dest`."""
    import shutil

    if dest.is_dir():
        return dest
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    for f in sorted(src.glob("*/*")):
        if not f.is_file():
            continue
        (tmp / f.parent.name).mkdir(parents=True, exist_ok=True)
        for i in range(repeat):
            target = tmp / f.parent.name / f"{f.stem}_{i}{f.suffix}"
            try:
                os.link(f, target)
            except OSError:
                shutil.copyfile(f, target)
    tmp.rename(dest)
    return dest


def loader(args: argparse.Namespace) -> None:
    """Images/s that the recipe's training loader delivers with each count in `--loader-workers`
    processes; prints one JSON record per count. The first `workers` batches (every process's first,
    which includes its start-up) are not timed; the rate is over the rest of one pass over the data."""
    from torch.utils.data import DataLoader

    train = recipe()
    data = Path(args.data)
    if args.repeat > 1:
        data = repeated_image_folder(data, Path(args.output_dir) / f"images-x{args.repeat}", args.repeat)
    samples, _ = train.list_image_folder(str(data))
    dataset = train.ImageDataset(samples, train.ImageTransform(args.size, train=True))
    for workers in args.loader_workers:
        batches = len(samples) // args.batch
        if batches <= workers:
            raise SystemExit(f"{len(samples)} images make {batches} batches of {args.batch}: too few to time "
                             f"{workers} loader processes; raise --repeat")
        it = iter(DataLoader(dataset, batch_size=args.batch, shuffle=True, drop_last=True, num_workers=workers))
        for _ in range(workers):
            next(it)
        t0, n = time.perf_counter(), 0
        for images, _ in it:
            n += images.shape[0]
        seconds = time.perf_counter() - t0
        del it
        print(json.dumps({"mode": "loader", "data": str(data), "images": len(samples), "batch": args.batch,
                          "loader_workers": workers, "cpus": os.cpu_count(), "timed_images": n,
                          "seconds": seconds, "images_per_s": n / seconds,
                          "images_per_s_per_worker": n / seconds / workers}), flush=True)


def real(args: argparse.Namespace) -> None:
    """Run the recipe on an ImageFolder with `--gpus` workers; print images/s per GPU: the median of the
    logged windows (the slowest dropped), and over the whole loop (first to last logged step), which
    includes evaluation, checkpoints and epoch starts."""
    out = Path(args.output_dir) / f"real-{args.gpus}gpu"
    data = Path(args.data)
    if args.repeat > 1:
        data = repeated_image_folder(data, Path(args.output_dir) / f"images-x{args.repeat}", args.repeat)
    cmd = ["bash", str(RECIPE / "launch.sh"), f"output_dir={out}", f"data.train_dir={data}", f"ray.num_workers={args.gpus}",
           f"train.epochs={args.epochs}", f"train.micro_batch_size={args.batch}", f"data.num_workers={args.loader_workers}",
           f"ray.cpus_per_worker={args.loader_workers + 1}", "model.pretrained=false", "train.log_every=5", "mlflow=false",
           *args.overrides]
    subprocess.run(cmd, check=True, env={**os.environ, "NNODES": "1"})
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["event"] == "train"]
    rates = sorted(r["samples_per_s_per_device"] for r in train)[1:]  # drop the slowest (start-up)
    whole = (args.batch * (train[-1]["step"] - train[0]["step"]) / (train[-1]["time"] - train[0]["time"])
             if len(train) > 1 else None)
    print(json.dumps({"mode": "real", "gpus": args.gpus, "data": str(data), "batch_per_gpu": args.batch,
                      "loader_workers": args.loader_workers, "steps": train[-1]["step"] if train else 0,
                      "median_images_per_s_per_gpu": rates[len(rates) // 2] if rates else None,
                      "whole_loop_images_per_s_per_gpu": whole}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("synthetic")
    s.add_argument("--steps", type=int, default=100)
    s.add_argument("--warmup", type=int, default=20)
    s.add_argument("--batch", type=int, default=256)
    s.add_argument("--size", type=int, default=224)
    s.add_argument("--backend", default="auto")
    s.add_argument("--compile", action="store_true")
    ld = sub.add_parser("loader")
    ld.add_argument("--data", required=True)
    ld.add_argument("--repeat", type=int, default=1, help="link each image this many times (longer passes)")
    ld.add_argument("--batch", type=int, default=128)
    ld.add_argument("--size", type=int, default=224)
    ld.add_argument("--loader-workers", type=int, nargs="+", default=[14])
    ld.add_argument("--output-dir", default="outputs/bench-resnet50-ray")
    r = sub.add_parser("real")
    r.add_argument("--data", required=True)
    r.add_argument("--gpus", type=int, default=1)
    r.add_argument("--epochs", type=int, default=3)
    r.add_argument("--repeat", type=int, default=1, help="link each image this many times (longer epochs)")
    r.add_argument("--batch", type=int, default=128)
    r.add_argument("--loader-workers", type=int, default=7)
    r.add_argument("--output-dir", default="outputs/bench-resnet50-ray")
    r.add_argument("overrides", nargs="*")
    args = p.parse_args()
    {"synthetic": synthetic, "loader": loader, "real": real}[args.mode](args)


if __name__ == "__main__":
    main()
