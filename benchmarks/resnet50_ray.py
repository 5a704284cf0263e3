"""ResNet-50 throughput, images/s per GPU, for recipes/resnet50-ray-ddp.

Three measurements, so that the bottleneck is visible:

- ``synthetic``: the recipe's own ``train_step`` (bf16 autocast, channels-last, SGD, DDP) on uint8
  images already on the GPU: the compute ceiling, no data pipeline. Runs under torchrun, no Ray
  needed (Ray's 79 MB wheel may not travel to the GPU machine).
- ``loader``: the recipe's own training data pipeline (``ImageDataset`` + ``ImageTransform`` in a
  ``DataLoader``: JPEG decode, random resized crop, flip, uint8 batches) on the host's CPUs with no
  model, no GPU and no Ray: the pipeline's ceiling, for several loader-process counts.
- ``pipeline``: the recipe's training data pipeline feeding its ``train_step`` on one GPU, no Ray:
  ``data.decode=cpu`` (PIL in the loader processes) against ``data.decode=gpu`` (loaders read bytes,
  nvJPEG decodes the batch, crop + resize + flip on the GPU), each with several loader-process counts,
  with the model (``--stages train``) and without it (``data``: the pipeline's own rate, batches on
  the GPU). One JSON line per combination (a failure is a line with ``error``).
- ``real``: the full recipe (Ray Train, JPEG decoding in data-loader workers) on an ImageFolder;
  read images/s per GPU from its metrics.jsonl. Needs Ray installed.

    # compute ceiling, 1 and 2 GPUs (prints one JSON line each)
    torchrun --nproc-per-node 1 benchmarks/resnet50_ray.py synthetic --steps 100 --batch 256
    torchrun --nproc-per-node 2 benchmarks/resnet50_ray.py synthetic --steps 100 --batch 256
    # data pipeline ceiling on this host's CPUs, 14 and 28 loader processes (one JSON line each)
    python benchmarks/resnet50_ray.py loader --data /data/hymenoptera_data/train --repeat 200 --loader-workers 14 28
    # data.decode cpu against gpu on one GPU, with and without the model (8 JSON lines)
    python benchmarks/resnet50_ray.py pipeline --data /data/hymenoptera_data/train --repeat 200 --decode cpu gpu \
        --loader-workers 14 4 --stages train data
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
        print(
            json.dumps(
                {
                    "mode": "synthetic",
                    "gpus": info.world_size,
                    "device": torch.cuda.get_device_name() if on_gpu else "cpu",
                    "backend": type(model).__module__.split(".")[0],
                    "batch_per_gpu": args.batch,
                    "compile": args.compile,
                    "median_step_s": median,
                    "images_per_s_per_gpu": args.batch / median,
                    "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None,
                    "torch": torch.__version__,
                }
            )
        )
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
            raise SystemExit(
                f"{len(samples)} images make {batches} batches of {args.batch}: too few to time "
                f"{workers} loader processes; raise --repeat"
            )
        it = iter(DataLoader(dataset, batch_size=args.batch, shuffle=True, drop_last=True, num_workers=workers))
        for _ in range(workers):
            next(it)
        t0, n = time.perf_counter(), 0
        for images, _ in it:
            n += images.shape[0]
        seconds = time.perf_counter() - t0
        del it
        print(
            json.dumps(
                {
                    "mode": "loader",
                    "data": str(data),
                    "images": len(samples),
                    "batch": args.batch,
                    "loader_workers": workers,
                    "cpus": os.cpu_count(),
                    "timed_images": n,
                    "seconds": seconds,
                    "images_per_s": n / seconds,
                    "images_per_s_per_worker": n / seconds / workers,
                }
            ),
            flush=True,
        )


def pipeline(args: argparse.Namespace) -> None:
    """For each `--decode` x `--loader-workers` x `--stages`: images/s of the recipe's training batches
    (shuffled, drop_last) on this process's device, through ``device_batch`` as ``train_loop`` does, and
    with ``train`` also its ``train_step`` (random init, bf16 autocast and channels-last on GPU). The first
    `workers` batches (the loader processes' start-up) and `--warmup` more are not timed; then up to
    `--steps` batches or `--max-seconds`, the device synchronised at both ends. One JSON line each."""
    train = recipe()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.type == "cuda"
    data = Path(args.data)
    if args.repeat > 1:
        data = repeated_image_folder(data, Path(args.output_dir) / f"images-x{args.repeat}", args.repeat)
    samples, classes = train.list_image_folder(str(data))
    if "gpu" in args.decode:
        print(json.dumps(_compare_decodes(train, samples[:32], device, args.size)), flush=True)
    for decode in args.decode:
        for workers in args.loader_workers:
            for stage in args.stages:
                record = {
                    "mode": "pipeline",
                    "decode": decode,
                    "stage": stage,
                    "loader_workers": workers,
                    "batch": args.batch,
                    "size": args.size,
                    "images": len(samples),
                    "cpus": os.cpu_count(),
                    "device": torch.cuda.get_device_name() if on_gpu else "cpu",
                    "torch": torch.__version__,
                }
                try:
                    record.update(_time_pipeline(train, samples, len(classes), decode, workers, stage, device, args))
                except Exception as exc:  # recorded; the other combinations still run
                    record["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                print(json.dumps(record), flush=True)


def _compare_decodes(train, samples, device: torch.device, size: int) -> dict:
    """Both decode paths on the same `samples` with the same random draws (seeded per image): the training
    crops of PIL (``data.decode=cpu``) against those of nvJPEG + ``random_resized_crop`` (``gpu``) on
    `device`; their absolute differences in uint8 levels, over all pixels and within the 1-pixel border."""
    import random

    record = {"mode": "pipeline-compare", "images": len(samples), "size": size}
    try:
        train.check_decode("gpu", on_cpu=device.type != "cuda")
        cpu = train.ImageDataset(samples, train.ImageTransform(size, train=True))
        gpu = train.EncodedImageDataset(samples)
        diffs = []
        for i in range(len(samples)):
            random.seed(i)
            expected = cpu[i][0].to(device)
            random.seed(i)
            images, _ = train.device_batch(train.collate_encoded([gpu[i]]), device, size)
            diffs.append((images[0].int() - expected.int()).abs())
        d = torch.stack(diffs)
        record.update(
            mean_abs_diff=d.float().mean().item(),
            max_abs_diff=d.max().item(),
            max_abs_diff_inside=d[:, :, 1:-1, 1:-1].max().item(),
            mean_abs_diff_inside=d[:, :, 1:-1, 1:-1].float().mean().item(),
        )
    except Exception as exc:
        record["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return record


def _time_pipeline(
    train,
    samples,
    num_classes: int,
    decode: str,
    workers: int,
    stage: str,
    device: torch.device,
    args: argparse.Namespace,
) -> dict:
    from torch.utils.data import DataLoader

    on_gpu = device.type == "cuda"
    train.check_decode(decode, on_cpu=not on_gpu)
    if decode == "gpu":
        dataset, kw = train.EncodedImageDataset(samples), {"collate_fn": train.collate_encoded}
    else:
        dataset, kw = train.ImageDataset(samples, train.ImageTransform(args.size, train=True)), {"pin_memory": on_gpu}
    model = opt = None
    if stage == "train":
        torch.manual_seed(0)
        model = train.build_model(train.ModelConfig(backend="auto", pretrained=False), num_classes).to(device)
        if on_gpu:
            model = model.to(memory_format=torch.channels_last)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    untimed = workers + args.warmup
    batches = len(samples) // args.batch
    if batches <= untimed:
        raise ValueError(f"{len(samples)} images make {batches} batches of {args.batch}: too few; raise --repeat")
    it = iter(DataLoader(dataset, batch_size=args.batch, shuffle=True, drop_last=True, num_workers=workers, **kw))

    def step():
        t0 = time.perf_counter()
        batch = next(it)
        waited = time.perf_counter() - t0
        if decode == "cpu":
            batch = tuple(t.to(device, non_blocking=True) for t in batch)  # as Ray's prepare_data_loader does
        images, labels = train.device_batch(batch, device, args.size)
        if model is not None:
            train.train_step(model, opt, images, labels, bf16=on_gpu, channels_last=on_gpu)
        return waited, labels.numel()

    for _ in range(untimed):
        step()
    if on_gpu:
        torch.cuda.synchronize()
    t0, n, steps, wait = time.perf_counter(), 0, 0, 0.0
    while steps < args.steps and steps < batches - untimed and time.perf_counter() - t0 < args.max_seconds:
        waited, count = step()
        wait, n, steps = wait + waited, n + count, steps + 1
    if on_gpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    it = None  # the loader's worker processes end with their iterator
    return {
        "timed_steps": steps,
        "timed_images": n,
        "seconds": seconds,
        "images_per_s": n / seconds,
        "data_wait_fraction": wait / seconds,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None,
    }


def real(args: argparse.Namespace) -> None:
    """Run the recipe on an ImageFolder with `--gpus` workers; print images/s per GPU: the median of the
    logged windows (the slowest dropped), and over the whole loop (first to last logged step), which
    includes evaluation, checkpoints and epoch starts."""
    out = Path(args.output_dir) / f"real-{args.gpus}gpu"
    data = Path(args.data)
    if args.repeat > 1:
        data = repeated_image_folder(data, Path(args.output_dir) / f"images-x{args.repeat}", args.repeat)
    cmd = [
        "bash",
        str(RECIPE / "launch.sh"),
        f"output_dir={out}",
        f"data.train_dir={data}",
        f"ray.num_workers={args.gpus}",
        f"train.epochs={args.epochs}",
        f"train.micro_batch_size={args.batch}",
        f"data.num_workers={args.loader_workers}",
        f"ray.cpus_per_worker={args.loader_workers + 1}",
        "model.pretrained=false",
        "train.log_every=5",
        "mlflow=false",
        *args.overrides,
    ]
    subprocess.run(cmd, check=True, env={**os.environ, "NNODES": "1"})
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["event"] == "train"]
    rates = sorted(r["samples_per_s_per_device"] for r in train)[1:]  # drop the slowest (start-up)
    whole = (
        args.batch * (train[-1]["step"] - train[0]["step"]) / (train[-1]["time"] - train[0]["time"])
        if len(train) > 1
        else None
    )
    print(
        json.dumps(
            {
                "mode": "real",
                "gpus": args.gpus,
                "data": str(data),
                "batch_per_gpu": args.batch,
                "loader_workers": args.loader_workers,
                "steps": train[-1]["step"] if train else 0,
                "median_images_per_s_per_gpu": rates[len(rates) // 2] if rates else None,
                "whole_loop_images_per_s_per_gpu": whole,
            }
        )
    )


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
    pp = sub.add_parser("pipeline")
    pp.add_argument("--data", required=True)
    pp.add_argument("--repeat", type=int, default=1, help="link each image this many times (longer passes)")
    pp.add_argument("--decode", nargs="+", choices=("cpu", "gpu"), default=["cpu", "gpu"])
    pp.add_argument("--loader-workers", type=int, nargs="+", default=[14])
    pp.add_argument("--stages", nargs="+", choices=("train", "data"), default=["train", "data"])
    pp.add_argument("--batch", type=int, default=128)
    pp.add_argument("--size", type=int, default=224)
    pp.add_argument("--warmup", type=int, default=5, help="batches after the loaders' first, not timed")
    pp.add_argument("--steps", type=int, default=120)
    pp.add_argument("--max-seconds", type=float, default=30.0, help="stop timing a combination after this long")
    pp.add_argument("--output-dir", default="outputs/bench-resnet50-ray")
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
    {"synthetic": synthetic, "loader": loader, "pipeline": pipeline, "real": real}[args.mode](args)


if __name__ == "__main__":
    main()
