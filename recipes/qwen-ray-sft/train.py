"""Full-parameter supervised fine-tuning of Qwen2.5-3B with Ray Train (TorchTrainer, DDP, one worker per GPU).

Commands (from this folder):

    ./launch.sh                                                  # Qwen2.5-3B-Instruct on Alpaca (hub), all GPUs of this node
    ./launch.sh data.train_files=[chat.jsonl] model.name_or_path=/models/Qwen2.5-3B-Instruct
    CONFIG_FILE=tiny.yaml ./launch.sh                            # tiny Qwen2, offline tokenizer and data, CPU
    RAY_ADDRESS=10.0.0.1:6379 ./launch.sh                        # an existing Ray cluster

The same data and loss as ../qwen-fsdp2-sft (cookbook.sft), DDP through Ray instead of FSDP2 under torchrun:
``train_loop`` runs on every Ray worker (``prepare_model``, ``prepare_data_loader``, ``no_sync``, a checkpoint
through ``ray.train.report``), ``main`` is the driver. What it supports: README.md beside this file.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import warnings
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", message=".*set_vital.*")

import cookbook  # first: a package built for another torch is one line (cookbook.builds)
import torch
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, get_scheduler
from transformers import logging as hf_logging

from cookbook import config, lm, ray_train, sft
from cookbook.checkpoint import CheckpointError
from cookbook.config import ConfigError, check_fields, load_config
from cookbook.hub import model_folder
from cookbook.metrics import ModelFlops, count_parameters

hf_logging.disable_progress_bar()


# ----------------------------------------------------------------------------- config
@dataclass
class ModelConfig:
    name_or_path: str = "Qwen/Qwen2.5-3B-Instruct"  # hub id or local folder
    pretrained: bool = True  # False: random init from config.json (benchmarks, CI)
    tokenizer: str | None = None  # default: name_or_path
    attn_implementation: str = "sdpa"


@dataclass
class TrainConfig(config.TrainConfig):
    grad_accum_steps: int = 4
    activation_checkpointing: str = "full"  # full: recompute each layer's activations in backward; none


@dataclass
class Config(config.RunConfig):
    output_dir: str = "outputs/qwen2.5-3b-ray-sft"  # Ray's run folder; shared storage on several nodes
    run_name: str = "qwen2.5-3b-ray-sft"
    ray: ray_train.RayConfig = field(default_factory=ray_train.RayConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: sft.DataConfig = field(default_factory=sft.DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: config.HFCheckpointConfig = field(default_factory=config.HFCheckpointConfig)


# Settings that may differ between a checkpoint and the run that resumes it; any other change is refused.
MAY_CHANGE = (*config.MAY_CHANGE, *sft.MAY_CHANGE, "ray.*")


def check_config(cfg: Config, config_dir: Path) -> None:
    """Resolve paths against the config file's folder and reject incompatible values."""
    sft.resolve_paths(cfg, config_dir)  # model, tokenizer and data files beside the config file
    cfg.output_dir = str(Path(cfg.output_dir).expanduser().resolve())  # workers may start elsewhere
    config.check_run(cfg)
    sft.check_data_config(cfg)
    check_fields(cfg, one_of={"train.activation_checkpointing": ("none", "full")})


# ----------------------------------------------------------------------------- model
def build_model(cfg: ModelConfig, vocab_needed: int, device: torch.device) -> torch.nn.Module:
    """The causal LM, pretrained or randomly initialised from its config (fp32 master weights), on
    `device`. A random init is generated there directly: on the CPU, a 3 B model takes minutes. A hub id is
    read from the Hugging Face cache (downloaded there by the driver's check when it runs on this machine)."""
    if cfg.pretrained:
        model = AutoModelForCausalLM.from_pretrained(
            model_folder(cfg.name_or_path), dtype=torch.float32, attn_implementation=cfg.attn_implementation
        ).to(device)
    else:
        hf_config = AutoConfig.from_pretrained(cfg.name_or_path, attn_implementation=cfg.attn_implementation)
        with device:
            model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    if vocab_needed > model.config.vocab_size:
        raise ConfigError(
            f"the tokenizer has {vocab_needed} tokens but the model's vocab_size is "
            f"{model.config.vocab_size}: use the model's own tokenizer"
        )
    return model


# ----------------------------------------------------------------------------- worker
def train_loop(config_dict: dict) -> None:
    """What every Ray Train worker runs: set-up, the step loop with periodic checkpoints, export."""
    import ray.train.torch

    cfg: Config = ray_train.config_from_dict(Config, config_dict)
    info = ray_train.worker_info()
    torch.manual_seed(cfg.train.seed)
    use_bf16 = info.device.type == "cuda" and cfg.train.mixed_precision == "bf16"

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16) if use_bf16 else contextlib.nullcontext()

    # ---- set-up: data, model (DDP), optimizer, resume
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer)
    pad_id = sft.pad_token_id(tokenizer)
    train_rows, eval_rows, stats = sft.training_rows(cfg.data, tokenizer, cfg.train.seed)
    loader = ray.train.torch.prepare_data_loader(
        DataLoader(
            train_rows,
            batch_size=cfg.train.micro_batch_size,
            shuffle=True,
            drop_last=True,
            collate_fn=partial(sft.collate, pad_id=pad_id),
            num_workers=cfg.data.num_workers,
            pin_memory=info.device.type == "cuda",
        )
    )
    steps_per_epoch = len(loader) // cfg.train.grad_accum_steps
    if steps_per_epoch == 0:
        raise ConfigError(
            f"{len(train_rows)} training rows are too few for one step of {cfg.train.micro_batch_size} x "
            f"{cfg.train.grad_accum_steps} x {info.world_size} rows"
        )
    max_steps = cfg.train.max_steps if cfg.train.max_steps > 0 else cfg.train.epochs * steps_per_epoch

    inner = build_model(cfg.model, len(tokenizer), info.device)
    if cfg.train.activation_checkpointing == "full":
        inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hf = inner.config
    flops = ModelFlops(
        count_parameters(inner),
        hf.num_hidden_layers,
        hf.num_attention_heads * getattr(hf, "head_dim", hf.hidden_size // hf.num_attention_heads),
    )
    model = ray.train.torch.prepare_model(inner)  # DDP
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=cfg.optim.lr,
        betas=tuple(cfg.optim.betas),
        eps=cfg.optim.eps,
        weight_decay=cfg.optim.weight_decay,
        fused=info.device.type == "cuda",
    )
    scheduler = get_scheduler(
        cfg.optim.scheduler,
        optimizer,
        num_warmup_steps=int(cfg.optim.warmup_ratio * max_steps),
        num_training_steps=max_steps,
    )

    def evaluate() -> dict[str, float]:
        eval_batches = DataLoader(
            eval_rows[info.rank :: info.world_size],
            batch_size=cfg.train.micro_batch_size,
            collate_fn=partial(sft.collate, pad_id=pad_id),
        )  # each worker a disjoint slice
        return sft.evaluate(model, eval_batches, info.device, context=autocast)

    run = ray_train.WorkerRun(
        cfg,
        info,
        "qwen-ray-sft",
        {"model": inner, "optimizer": optimizer, "scheduler": scheduler},
        max_steps=max_steps,
        steps_per_epoch=steps_per_epoch,
        stop_at=("train.stop_at_step", cfg.train.stop_at_step),
        evaluate=evaluate if eval_rows else None,
        flops=flops,
        about=f"{flops.num_params / 1e6:,.1f} M non-embedding params | {len(train_rows)} train / {len(eval_rows)} eval "
        f"rows of {'packed ' if cfg.data.packing else ''}<= {cfg.data.max_length} tokens | global batch "
        f"{cfg.train.micro_batch_size * cfg.train.grad_accum_steps * info.world_size} rows | "
        f"{'bf16 autocast' if use_bf16 else 'fp32'} | data: {stats.summary()}",
    )

    def batches():
        """Micro-batches from the resumed step on: the sampler's order of each epoch, replayed after a resume
        (a skipped non-finite step took a step's batches too)."""
        epoch, skip = divmod(run.batches, steps_per_epoch)
        while True:
            if info.world_size > 1:
                loader.sampler.set_epoch(epoch)
            usable = itertools.islice(iter(loader), steps_per_epoch * cfg.train.grad_accum_steps)
            yield from itertools.islice(usable, skip * cfg.train.grad_accum_steps, None)
            epoch, skip = epoch + 1, 0

    # ---- train loop: DDP with gradient accumulation (no_sync), a checkpoint every checkpoint.every_steps
    data_iter = run.timed(batches())
    with run:
        for _ in run.steps():
            optimizer.zero_grad(set_to_none=True)  # also drops a skipped step's gradients
            micro = [next(data_iter) for _ in range(cfg.train.grad_accum_steps)]  # (batch, data wait)
            # Normalise by the labelled tokens of the whole global batch; DDP averages over workers.
            local_tokens = sum((mb["labels"][:, 1:] != sft.IGNORE_INDEX).sum() for mb, _ in micro)
            global_tokens = max(cookbook.all_reduce_sum({"t": local_tokens}, info.device)["t"], 1.0)
            step_loss = torch.zeros((), device=info.device)
            for i, (mb, wait) in enumerate(micro):
                with contextlib.nullcontext() if i == len(micro) - 1 else model.no_sync():
                    with autocast():
                        loss_sum = sft.token_loss_sum(model, mb)
                    (loss_sum * info.world_size / global_tokens).backward()
                step_loss += loss_sum.detach() * info.world_size / global_tokens
                run.metrics.add(samples=mb["input_ids"].shape[0], tokens=lm.count_tokens(mb, pad_id), data_wait_s=wait)
            grad_norm = torch.nn.utils.clip_grad_norm_(
                model.parameters(), cfg.optim.max_grad_norm if cfg.optim.max_grad_norm > 0 else float("inf")
            )
            if run.skip_step(grad_norm):
                continue  # NaN / inf: the run stops, or (train.on_nonfinite=skip) the step is dropped
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            if run.end_step(step_loss, lr=lr, grad_norm=grad_norm):  # every checkpoint.every_steps, at the stop point
                with run.checkpoint() as saved:  # state.pt + meta.json on rank 0, in a temporary folder
                    ray.train.report(**saved)  # every worker; Ray registers checkpoint_step_<n> once all have reported

        # ---- save: final evaluation, Hugging Face export (Ray Train destroys the process group)
        def export() -> dict:
            final = Path(cfg.output_dir) / "final"
            if cfg.checkpoint.export_hf and info.is_main:  # DDP: rank 0 holds the whole model
                inner.save_pretrained(final, safe_serialization=True)
                tokenizer.save_pretrained(final)
            return {
                "export_dir": (
                    final if cfg.checkpoint.export_hf and info.is_main else None,
                    "AutoModelForCausalLM.from_pretrained",
                )
            }

        run.finish(inner, export=export)


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
    driver = ray_train.RayDriver(cfg, ("train.stop_at_step", cfg.train.stop_at_step))  # the workers planned here
    tokenizer = sft.load_tokenizer(cfg.model.tokenizer, cfg.model.name_or_path, cfg.data.max_length)
    lm.check_attention(cfg.model.attn_implementation, on_cpu=driver.on_cpu)
    data_note = sft.check_data(
        cfg.data, tokenizer, cfg.train.seed, cfg.train.micro_batch_size, cfg.train.grad_accum_steps, driver.workers or 1
    )
    driver.check_resume(MAY_CHANGE)
    if cfg.model.pretrained:  # a hub id is downloaded here, once, before the workers start
        model_folder(cfg.model.name_or_path)
    return driver, data_note


def show_examples(cfg: Config, n: int) -> str:
    return sft.show_data(cfg.data, sft.load_tokenizer(cfg.model.tokenizer, cfg.model.name_or_path), n)


@cookbook.cli(load, preflight, show_examples, sized=False)  # --check: preflight; --show-examples N: show_examples
def main(cfg: Config) -> None:
    driver, _ = driver_checks(cfg)
    total = cfg.train.max_steps if cfg.train.max_steps > 0 else None  # else the data decides, in the workers
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    # Already complete: said, exit 0. Else Ray started or joined, the workers sized; SIGTERM / SIGUSR1: a stop request.
    with driver.started(total, {"model": Path(cfg.output_dir) / "final"}):
        trainer = TorchTrainer(
            **driver.worker_loop(__file__),  # each worker imports this file and runs its train_loop(config)
            scaling_config=ScalingConfig(**driver.scaling),  # ray.num_workers DDP processes, one per GPU on GPUs
            run_config=RunConfig(**driver.run_options),  # output_dir, checkpoint.keep_last, ray.max_failures
        )
        driver.finish(trainer.fit())


if __name__ == "__main__":
    cookbook.run_main(main, user_errors=(ConfigError, sft.SFTDataError, CheckpointError))
