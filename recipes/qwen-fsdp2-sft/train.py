"""Full-parameter supervised fine-tuning of causal language models with FSDP2 (``fully_shard``), HSDP across nodes.

Commands (from this folder; NGPU defaults to all visible GPUs, else 2 CPU processes):

    ./launch.sh                                           # Qwen3-8B on Alpaca (hub), all GPUs of this node
    CONFIG_FILE=tiny.yaml ./launch.sh                     # tiny Qwen3, offline, CPU-friendly
    CONFIG_FILE=qwen2.5-3b.yaml ./launch.sh data.train_files=[chat.jsonl]
    NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 CONFIG_FILE=llama3.1-8b-2nodes.yaml ./launch.sh   # each node

``build_model`` builds on the meta device, wraps each decoder layer (activation checkpointing, optional compile and
float8), shards it with ``fully_shard`` and then loads the safetensors shard by shard (or draws random weights);
``main`` is the loop. What it supports (data, loss, checkpoints, float8): README.md beside this file.
"""

from __future__ import annotations

import inspect
import os
import warnings
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore", message=".*set_vital.*")

import cookbook  # first: a package built for another torch is one line (cookbook.builds)
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from torchdata.stateful_dataloader import StatefulDataLoader
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers import logging as hf_logging

from cookbook import lm, sft
from cookbook.checkpoint import Checkpointer, CheckpointError, ModelOptimizerState, export_hf
from cookbook import config
from cookbook.config import ConfigError, check_fields, load_config, to_dict
from cookbook.hub import model_folder
from cookbook.loop import Run
from cookbook.metrics import ModelFlops, count_parameters
from cookbook.config import build_optimizer
from cookbook.sampler import ResizableSampler

hf_logging.disable_progress_bar()
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


# ----------------------------------------------------------------------------- config
@dataclass
class ModelConfig:
    name_or_path: str = "Qwen/Qwen3-8B"  # hub id or local folder (config.json, *.safetensors)
    pretrained: bool = True  # False: random init from config.json (benchmarks, CI)
    tokenizer: str | None = None  # default: name_or_path
    attn_implementation: str = "sdpa"  # varlen (GPU), sdpa, eager, flex_attention, flash_attention_2


@dataclass
class FSDPConfig:
    reduce_dtype: str = "fp32"  # gradient reduce-scatter dtype
    reshard_after_forward: bool = True  # False keeps gathered layers until backward (more memory, less traffic)
    cpu_offload: bool = False  # parameters, gradients and optimizer state in CPU memory
    replicate_degree: int = 1  # HSDP: > 1 replicates across this many groups and shards within each


@dataclass
class TrainConfig(config.TrainConfig):
    activation_checkpointing: str = "selective"  # none, selective (saves matmul and attention outputs), full
    compile: bool = False  # torch.compile each decoder layer
    loss: str = "chunked"  # chunked (logits loss_chunk_size labelled tokens at a time) or full (the model's logits)
    loss_chunk_size: int = 4096  # labelled tokens per chunk of train.loss=chunked
    float8: bool = False  # torchao Float8Linear for the decoder layers' linears (GPU capability >= 8.9, train.compile)


@dataclass
class CheckpointConfig(config.HFCheckpointConfig):
    export_dtype: str = "bf16"  # dtype of the exported weights


@dataclass
class Config(config.RunConfig):
    model: ModelConfig = field(default_factory=ModelConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    data: sft.DataConfig = field(default_factory=sft.DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


# Settings that may differ between a checkpoint and the run that resumes it; any other change is refused.
MAY_CHANGE = config.MAY_CHANGE + sft.MAY_CHANGE + ("train.loss", "train.loss_chunk_size")  # the same objective
RESIZABLE = True  # resumes on another world size (global data position); cookbook.checkpoint.resizable_recipes


def check_config(cfg: Config, config_dir: Path) -> None:
    """Resolve paths against the config file's folder and reject incompatible values."""
    sft.resolve_paths(cfg, config_dir)  # model, tokenizer and data files beside the config file
    config.check_run(cfg)
    sft.check_data_config(cfg)
    check_fields(
        cfg,
        at_least={"fsdp.replicate_degree": 1, "train.loss_chunk_size": 1},
        one_of={
            "fsdp.reduce_dtype": sorted(DTYPES),
            "checkpoint.export_dtype": sorted(DTYPES),
            "train.activation_checkpointing": ("none", "selective", "full"),
            "train.loss": ("chunked", "full"),
        },
    )


# ----------------------------------------------------------------------------- model
def _sac_policy(ctx, op, *args, **kwargs):
    """Selective activation checkpointing: keep matmul and attention outputs, recompute the rest."""
    keep = {
        torch.ops.aten.mm.default,
        torch.ops.aten.addmm.default,
        torch.ops.aten.bmm.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    }
    varlen_op = getattr(torch.ops.torch_attn, "_varlen_attn", None)  # varlen's kernel
    if varlen_op is not None:
        keep.add(varlen_op.default)
    return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE


def check_float8(cfg: TrainConfig, device: torch.device) -> None:
    """Refuse ``train.float8=true`` where it cannot run or would not pay.

    Raises:
        ConfigError: without ``train.compile`` (torchao's float8 training is documented for use with
            ``torch.compile``, which fuses the scaling and casting around each matmul), with selective
            activation checkpointing (its recomputation did not find a saved op of the float8 forward; eager
            and compiled, on CPU, torch 2.13, torchao 0.18), on a device other than a
            CUDA GPU of compute capability 8.9 or newer (``torch._scaled_mm``'s float8 kernels: Ada, Hopper,
            Blackwell), or when torchao is not installed.
    """
    if not cfg.float8:
        return
    if not cfg.compile:
        raise ConfigError(
            "train.float8=true needs train.compile=true: uncompiled, torchao's scaling and casting run "
            "as separate kernels around every matmul"
        )
    if cfg.activation_checkpointing == "selective":
        raise ConfigError(
            "train.float8=true does not work with train.activation_checkpointing=selective (its backward "
            "failed: 'aten.slice.Tensor invocation ... not found in storage', torchao 0.18): use none or full"
        )
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if capability is None or capability < (8, 9):
        where = f"compute capability {capability[0]}.{capability[1]}" if capability else f"a {device.type} device"
        raise ConfigError(
            f"train.float8=true needs a CUDA GPU of compute capability 8.9 or newer (float8 matmuls); "
            f"this run has {where}: set train.float8=false"
        )
    try:
        import torchao.float8  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"train.float8=true needs torchao: pip install -r requirements/float8.txt ({exc})") from None


def float8_module_filter(module: torch.nn.Module, fqn: str) -> bool:
    """Which linears ``train.float8`` converts: those whose input and output sizes are multiples of 16
    (``torch._scaled_mm`` needs them; a decoder layer's projections of the supported models all are)."""
    return isinstance(module, torch.nn.Linear) and module.in_features % 16 == 0 and module.out_features % 16 == 0


def build_model(cfg: Config, info: cookbook.DistInfo, vocab_size_needed: int) -> tuple[torch.nn.Module, ModelFlops]:
    """Build on the meta device, wrap layers (AC, compile), shard with FSDP2, then materialise:
    load the safetensors shards this rank owns, or initialise randomly.

    Raises:
        ConfigError: the tokenizer has more tokens than the model's vocabulary, ``train.loss=chunked`` on a model
            whose forward takes no ``logits_to_keep``, ``train.float8`` where it cannot run (`check_float8`), or an
            ``fsdp.replicate_degree`` that does not divide the world size.
    """
    sft.register_varlen()  # attn_implementation: varlen (cookbook.sft.attention)
    hf_config = AutoConfig.from_pretrained(cfg.model.name_or_path, attn_implementation=cfg.model.attn_implementation)
    if vocab_size_needed > hf_config.vocab_size:
        raise ConfigError(
            f"the tokenizer has {vocab_size_needed} tokens but the model's vocab_size is "
            f"{hf_config.vocab_size}: use the model's own tokenizer"
        )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    if cfg.train.loss == "chunked" and "logits_to_keep" not in inspect.signature(model.forward).parameters:
        raise ConfigError(
            f"train.loss=chunked: {type(model).__name__}.forward takes no logits_to_keep, so it cannot "
            f"skip its logits; use train.loss=full"
        )
    flops = ModelFlops(
        count_parameters(model),
        hf_config.num_hidden_layers,
        hf_config.num_attention_heads
        * getattr(hf_config, "head_dim", hf_config.hidden_size // hf_config.num_attention_heads),
    )
    layers = model.model.layers
    if cfg.train.float8:  # the decoder layers' linears only: embeddings and lm_head stay in bf16
        check_float8(cfg.train, info.device)  # before the import: a missing torchao is refused with the fix
        from torchao.float8 import convert_to_float8_training

        convert_to_float8_training(layers, module_filter_fn=float8_module_filter)
    for i, layer in enumerate(layers):
        if cfg.train.activation_checkpointing == "full":
            layer = checkpoint_wrapper(layer, preserve_rng_state=False)
        elif cfg.train.activation_checkpointing == "selective":
            layer = checkpoint_wrapper(
                layer, preserve_rng_state=False, context_fn=partial(create_selective_checkpoint_contexts, _sac_policy)
            )
        if cfg.train.compile:
            layer.compile()
        layers[i] = layer

    if cfg.fsdp.replicate_degree > 1:
        if info.world_size % cfg.fsdp.replicate_degree:
            raise ConfigError(
                f"fsdp.replicate_degree={cfg.fsdp.replicate_degree} does not divide the world size {info.world_size}"
            )
        mesh = init_device_mesh(
            info.device.type,
            (cfg.fsdp.replicate_degree, info.world_size // cfg.fsdp.replicate_degree),
            mesh_dim_names=("replicate", "shard"),
        )
    else:
        mesh = init_device_mesh(info.device.type, (info.world_size,), mesh_dim_names=("shard",))
    param_dtype = DTYPES[cfg.train.mixed_precision] if info.device.type == "cuda" else torch.float32
    fsdp_kwargs = dict(
        mesh=mesh,
        reshard_after_forward=cfg.fsdp.reshard_after_forward,
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=DTYPES[cfg.fsdp.reduce_dtype]),
    )
    if cfg.fsdp.cpu_offload:
        fsdp_kwargs["offload_policy"] = CPUOffloadPolicy()
    for layer in layers:
        fully_shard(layer, **fsdp_kwargs)
    fully_shard(model, **fsdp_kwargs)  # root: embeddings, final norm, lm_head (tied weights stay together)

    model.to_empty(device="cpu" if cfg.fsdp.cpu_offload else info.device)
    # Random weights (the same whatever the number of ranks, the sharding and the offload), and the
    # non-persistent buffers (rotary inv_freq), which a checkpoint does not hold.
    lm.init_sharded_weights(model, cfg.train.seed, info.device)
    if cfg.model.pretrained:
        # get_model_state_dict gives Hugging Face names (no activation-checkpoint or compile prefixes) and
        # this rank's DTensor shards: each rank reads only its slices of the safetensors files.
        state = {
            k: v
            for k, v in get_model_state_dict(model).items()
            if not (hf_config.tie_word_embeddings and k == "lm_head.weight")
        }
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(model_folder(cfg.model.name_or_path))))
        set_model_state_dict(model, state, options=StateDictOptions(strict=False))
    return model, flops


# ----------------------------------------------------------------------------- recipe
def load(path: str, overrides: list[str]) -> Config:
    cfg = load_config(Config, path, overrides)
    check_config(cfg, Path(path).resolve().parent)
    return cfg


def preflight(cfg: Config, world_size: int) -> str:
    """What ``--check`` runs in one process before torchrun starts any worker (launch.sh): model download,
    attention, float8 and sharding checks, every data row, then the resume; returns what the data holds."""
    if cfg.model.pretrained:  # a hub id is downloaded here, once, before any worker starts
        model_folder(cfg.model.name_or_path)
    tokenizer = sft.load_tokenizer(cfg.model.tokenizer, cfg.model.name_or_path, cfg.data.max_length)
    on_cpu = cookbook.get_dist_info().device.type == "cpu"  # COOKBOOK_DEVICE=cpu, or no GPU
    if cfg.model.attn_implementation == "varlen" and on_cpu:
        raise ConfigError("model.attn_implementation=varlen runs on CUDA GPUs only: use sdpa on CPU")
    lm.check_attention(cfg.model.attn_implementation, on_cpu)
    check_float8(cfg.train, cookbook.get_dist_info().device)
    if cfg.fsdp.cpu_offload and on_cpu:
        raise ConfigError(
            "fsdp.cpu_offload=true needs GPUs: it moves shards from GPU to CPU memory, and on a CPU run "
            "they are in CPU memory already"
        )
    if cfg.fsdp.replicate_degree > 1 and world_size % cfg.fsdp.replicate_degree:
        raise ConfigError(
            f"fsdp.replicate_degree={cfg.fsdp.replicate_degree} does not divide the world size {world_size}"
        )
    data = sft.check_data(
        cfg.data, tokenizer, cfg.train.seed, cfg.train.micro_batch_size, cfg.train.grad_accum_steps, world_size
    )  # before the resume: a bad row is named on a used output_dir too
    Checkpointer(Path(cfg.output_dir) / "checkpoints", resizable=RESIZABLE).check_resume(
        cfg.checkpoint.resume, world_size, to_dict(cfg), MAY_CHANGE, cfg.train.stop_at_step
    )
    return data


def show_examples(cfg: Config, n: int) -> str:
    return sft.show_data(cfg.data, sft.load_tokenizer(cfg.model.tokenizer, cfg.model.name_or_path), n)


@cookbook.cli(load, preflight, show_examples)  # --check: preflight; --show-examples N: show_examples
def main(cfg: Config) -> None:
    # ---- set-up
    info = cookbook.init_distributed(cfg.train.collective_timeout_s, debug_dir=Path(cfg.output_dir) / "debug")
    out_dir = Path(cfg.output_dir)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer)
    pad_id = sft.pad_token_id(tokenizer)
    # Packing: rows of exactly max_length tokens, documents separated by position ids.
    train_rows, eval_rows, stats = sft.training_rows(cfg.data, tokenizer, cfg.train.seed)
    # DistributedSampler's order and split, with a global position: a checkpoint resumes on another world size.
    # Run calls its set_epoch at each pass (a new shuffle per epoch).
    sampler = ResizableSampler(
        train_rows, num_replicas=info.world_size, rank=info.rank, shuffle=True, seed=cfg.train.seed, drop_last=True
    )
    loader_kw = dict(
        collate_fn=partial(sft.collate, pad_id=pad_id),
        num_workers=cfg.data.num_workers,
        pin_memory=info.device.type == "cuda",
    )
    train_loader = StatefulDataLoader(
        train_rows, batch_size=cfg.train.micro_batch_size, sampler=sampler, drop_last=True, **loader_kw
    )
    eval_loader = StatefulDataLoader(
        sft.shard_for_eval(eval_rows, info.rank, info.world_size), batch_size=cfg.train.micro_batch_size, **loader_kw
    )
    steps_per_epoch = len(train_loader) // cfg.train.grad_accum_steps
    if steps_per_epoch == 0:
        raise ConfigError(
            f"{len(train_rows)} training rows are too few for one step of {cfg.train.micro_batch_size} x "
            f"{cfg.train.grad_accum_steps} x {info.world_size} rows"
        )
    max_steps = cfg.train.max_steps if cfg.train.max_steps > 0 else cfg.train.epochs * steps_per_epoch

    model, flops = build_model(cfg, info, len(tokenizer))
    fused = info.device.type == "cuda" and not cfg.fsdp.cpu_offload
    optimizer, scheduler = build_optimizer(cfg.optim, model.parameters(), max_steps, fused=fused)
    evaluate = (lambda: sft.evaluate(model, eval_loader, info.device)) if eval_rows else None
    with Run(
        cfg,
        info,
        app=ModelOptimizerState(model, optimizer),
        scheduler=scheduler,
        loader=train_loader,
        may_change=MAY_CHANGE,
        max_steps=max_steps,
        experiment="fsdp2-sft",
        final=out_dir / "final" if cfg.checkpoint.export_hf else None,
        flops=flops,
        evaluate=evaluate,
    ) as run:
        run.say(
            f"world size {info.world_size} ({info.backend}) | FSDP2 mesh {'x'.join(map(str, model.model.embed_tokens.weight.device_mesh.shape))} | "
            f"{flops.num_params / 1e6:,.1f} M non-embedding params | {len(train_rows)} train rows of "
            f"{'packed ' if cfg.data.packing else ''}<= {cfg.data.max_length} tokens | global batch "
            f"{cfg.train.micro_batch_size * cfg.train.grad_accum_steps * info.world_size} rows | {max_steps} steps | AC "
            f"{cfg.train.activation_checkpointing} | loss {cfg.train.loss}"
            f"{f' ({cfg.train.loss_chunk_size} tokens per chunk)' if cfg.train.loss == 'chunked' else ''} | data: {stats.summary()}"
        )

        # ---- train loop
        chunk_size = cfg.train.loss_chunk_size if cfg.train.loss == "chunked" else 0  # 0: the model's full logits
        for _ in run.steps():
            optimizer.zero_grad(set_to_none=True)  # also drops a skipped step's gradients
            micro_batches, waits = run.take(cfg.train.grad_accum_steps)
            # Normalise by the labelled tokens of the whole global batch. FSDP averages gradients over
            # ranks, so each rank scales its summed loss by world_size / global tokens.
            # The count stays on the device (no wait for the previous step's kernels before this one's).
            global_tokens = sum((mb["labels"][:, 1:] != -100).sum() for mb in micro_batches).float()
            if info.world_size > 1:
                torch.distributed.all_reduce(global_tokens)
            global_tokens = global_tokens.clamp(min=1.0)
            step_loss = torch.zeros((), device=info.device)
            for mb, wait in zip(micro_batches, waits):
                loss_sum = sft.token_loss_sum(model, mb, chunk_size)
                (loss_sum * info.world_size / global_tokens).backward()
                step_loss += loss_sum.detach() / global_tokens * info.world_size
                run.metrics.add(samples=mb["input_ids"].shape[0], tokens=lm.count_tokens(mb, pad_id), data_wait_s=wait)
            grad_norm = torch.nn.utils.clip_grad_norm_(
                model.parameters(), cfg.optim.max_grad_norm if cfg.optim.max_grad_norm > 0 else float("inf")
            )
            if isinstance(grad_norm, torch.distributed.tensor.DTensor):
                grad_norm = grad_norm.full_tensor()
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
                    export_hf(model, out_dir / "final", tokenizer, dtype=DTYPES[cfg.checkpoint.export_dtype])
                    if cfg.checkpoint.export_hf
                    else None,
                    "AutoModelForCausalLM.from_pretrained",
                )
            }
        )

    # ---- clean-up
    cookbook.destroy_distributed()


if __name__ == "__main__":
    cookbook.run_main(main, user_errors=(ConfigError, sft.SFTDataError, CheckpointError))
