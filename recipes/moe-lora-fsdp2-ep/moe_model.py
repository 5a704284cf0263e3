"""The MoE LoRA model around the technique: config sections and checks (`MoELoraConfig`, `check_config`,
`check_model`), the base model on the meta device or whole (`build_base`), LoRA initialised the same for every
EP degree (`init_lora`), active-parameter FLOPs (`active_flops`), ``torch.compile`` and activation
checkpointing of parts of every decoder layer (`compile_parts`, `checkpoint_parts`), router statistics and the
Switch-Transformer load-balancing loss over the tokens that are not padding (`RouterStats`, `token_mask`), and
evaluation with the routers' records left out (`evaluate`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

import cookbook
from cookbook import config, sft
from cookbook.config import ConfigError, check_fields
from cookbook.lm import checkpoint_modules
from cookbook.metrics import ModelFlops, count_parameters
from expert_parallel import moe_blocks
from routed_lora import routed_experts_forward, routed_lora_unsupported

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


# ----------------------------------------------------------------------------- config
@dataclass
class ModelConfig:
    name_or_path: str = "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"  # hub id or local folder
    pretrained: bool = True  # False: random init from config.json (benchmarks, CI)
    lazy_load: bool = True  # pretrained: each rank reads its experts' slices and the dense weights from the
    #                         safetensors files (False: transformers' from_pretrained of the whole model per rank)
    tokenizer: str | None = None  # default: name_or_path (vision-language models: also the image processor)
    attn_implementation: str = "sdpa"


@dataclass
class ParallelConfig:
    ep: int = 1  # expert-parallel degree: divides the world size and the number of experts; 1 = off
    reduce_dtype: str = "fp32"  # gradient reduce-scatter dtype
    reshard_after_forward: bool = True
    fsdp_one_rank: bool = False  # on a world of one: true = fully_shard anyway (it shards nothing there; slower)


@dataclass
class LoraSection(config.ExpertLoraConfig):
    """``lora`` of the MoE recipes: `cookbook.config.ExpertLoraConfig` (r, alpha, dropout, target_modules,
    target_parameters), Nemotron-H's experts by default, and how the expert LoRA runs."""

    target_parameters: list[str] = field(default_factory=lambda: ["mixer.experts.up_proj", "mixer.experts.down_proj"])
    expert_lora: str = "routed"  # routed: LoRA on the routed tokens with grouped GEMMs (`use_routed_lora`);
    #                              peft: PEFT's forward (base + B @ A folded for every expert, every forward)


@dataclass
class MoESection:
    aux_loss_coef: float = 0.0  # > 0 adds coef x load-balancing loss to the objective (always reported)


@dataclass
class TrainConfig(config.TrainConfig):
    activation_checkpointing: str = "full"  # none; full: recompute each decoder layer in backward (transformers' own);
    #                                         attention / experts: recompute only that part of each layer (`checkpoint_parts`)
    compile: str = "none"  # torch.compile (`compile_parts`): moe: each MoE block's router and routed experts (routing
    #                        included); layers: each decoder layer whole (per-layer, before FSDP2); none


@dataclass
class CheckpointConfig(config.CheckpointConfig):
    export_adapter: bool = True
    export_merged: bool = False  # also <output_dir>/merged: base + adapter folded in (needs model.pretrained)
    push_to_hub: str = ""  # as config.HFCheckpointConfig's: the merged model if exported, else the adapter


@dataclass
class MoELoraConfig(config.RunConfig):
    """The sections of a MoE LoRA recipe's config but ``data``, which each recipe adds."""

    output_dir: str = "outputs/moe-lora"
    run_name: str = "moe-lora"
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoraSection = field(default_factory=LoraSection)
    moe: MoESection = field(default_factory=MoESection)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


# Settings that may differ between a checkpoint and the run that resumes it (with the recipe's data keys).
MAY_CHANGE = (
    *config.MAY_CHANGE,
    "model.lazy_load",
    "data.num_workers",
    "lora.expert_lora",
    "train.activation_checkpointing",
    "train.compile",
    "parallel.fsdp_one_rank",  # DCP checkpoints: DTensors of a world of one load into plain tensors and back
)
ACTIVATION_CHECKPOINTING = ("none", "full", "attention", "experts")
COMPILE = ("none", "moe", "layers")


def check_config(cfg: MoELoraConfig, config_dir: Path) -> None:
    """Resolve the model, tokenizer and data file paths against the config file's folder and reject values of
    the shared sections (and ``data.max_length``, ``data.eval_fraction``) that are wrong on their own.

    Raises:
        ConfigError: the first wrong value, naming its key.
    """
    sft.resolve_paths(cfg, config_dir)  # model, tokenizer and data files beside the config file
    config.check_run(cfg)
    check_fields(
        cfg,
        at_least={"parallel.ep": 1, "lora.r": 1, "data.max_length": 1, "moe.aux_loss_coef": 0},
        one_of={
            "parallel.reduce_dtype": sorted(DTYPES),
            "train.activation_checkpointing": ACTIVATION_CHECKPOINTING,
            "lora.expert_lora": ("routed", "peft"),
            "train.compile": COMPILE,
        },
        within={"lora.dropout": "[0, 1)", "data.eval_fraction": "[0, 1)"},
        notes={"data.eval_fraction": "0: no evaluation"},
    )
    if not cfg.lora.target_modules and not cfg.lora.target_parameters:
        raise ConfigError("lora.target_modules and lora.target_parameters are both empty: nothing would train")
    if cfg.lora.dropout > 0 and cfg.lora.target_parameters:
        raise ConfigError(
            "lora.dropout > 0 is not supported by PEFT for lora.target_parameters (expert weights): set 0"
        )
    if cfg.train.compile != "none" and cfg.lora.expert_lora != "routed":
        raise ConfigError(
            f"train.compile={cfg.train.compile} compiles the routed expert LoRA: it needs lora.expert_lora=routed "
            f"(or train.compile=none)"
        )
    if cfg.train.compile == "layers" and cfg.train.activation_checkpointing != "none":
        # full: transformers' checkpointed layer call bypasses the compiled one (measured: no graph made, eager
        # silently); attention / experts: not tried
        raise ConfigError(
            f"train.compile=layers with train.activation_checkpointing={cfg.train.activation_checkpointing} "
            f"is not supported: use train.compile=moe (works with every activation_checkpointing), or "
            f"train.activation_checkpointing=none"
        )
    if cfg.checkpoint.export_merged and not (cfg.model.pretrained and cfg.checkpoint.export_adapter):
        raise ConfigError(
            "checkpoint.export_merged=true folds the adapter into the base weights read from "
            "model.name_or_path: it needs model.pretrained=true and checkpoint.export_adapter=true"
        )


def _matches(name: str, target: str) -> bool:
    """PEFT's rule for a target given as a name: the whole name, or its dotted tail."""
    return name == target or name.endswith("." + target)


def check_model(cfg: MoELoraConfig, hf_config, auto_class, world_size: int) -> None:
    """Refuse an EP degree that does not fit the model or the job, and LoRA targets that match nothing, on the
    model built with `auto_class` on the meta device (no memory, a second even for 30 B parameters).

    Raises:
        ConfigError: ``parallel.ep`` > 1 without MoE layers, or not dividing the world size or the experts;
            a ``lora.target_modules`` / ``lora.target_parameters`` entry matching nothing (the message lists the
            names of the first layers); a target parameter that is not a fused 3-D expert weight;
            ``lora.expert_lora=routed`` on experts whose forward `routed_experts_forward` does not reproduce.
    """
    with torch.device("meta"):
        model = auto_class.from_config(hf_config)
    experts = [m for _, m in moe_blocks(model)]
    ep = cfg.parallel.ep
    if ep > 1 and not experts:
        raise ConfigError(
            f"parallel.ep={ep} but {cfg.model.name_or_path} ({hf_config.model_type}) has no MoE layers with "
            f"fused experts: use parallel.ep=1"
        )
    if world_size % ep:
        raise ConfigError(f"parallel.ep={ep} does not divide the world size {world_size} (NGPU x NNODES)")
    if experts and experts[0].experts.num_experts % ep:
        raise ConfigError(
            f"parallel.ep={ep} does not divide the {experts[0].experts.num_experts} experts of each MoE layer"
        )
    modules = [n for n, _ in model.named_modules()]
    params = [n for n, _ in model.named_parameters()]
    for key, names, wanted in [
        ("lora.target_modules", modules, cfg.lora.target_modules),
        ("lora.target_parameters", params, cfg.lora.target_parameters),
    ]:
        for target in wanted:
            if not any(_matches(n, target) for n in names):
                tails = sorted({".".join(n.split(".")[-2:]) for n in names if ".layers.0." in n or ".layers.1." in n})
                raise ConfigError(
                    f"{key}: {target!r} matches nothing in {hf_config.model_type}; names in its first "
                    f"layers end with: {', '.join(tails)}"
                )
        if key == "lora.target_parameters":
            for target in wanted:
                if any(_matches(n, target) and model.get_parameter(n).ndim != 3 for n in names):
                    raise ConfigError(
                        f"lora.target_parameters: {target!r} is not a fused 3-D expert weight; put "
                        f"linear layers in lora.target_modules"
                    )
    if cfg.lora.expert_lora == "routed" and cfg.lora.target_parameters and experts:
        reason = routed_lora_unsupported(experts[0].experts)
        if reason:
            raise ConfigError(
                f"lora.expert_lora=routed: the experts of {hf_config.model_type} {reason}; use lora.expert_lora=peft"
            )


# ----------------------------------------------------------------------------- model
def build_base(auto_class, hf_config, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int):
    """The base model, before LoRA and the expert split, in `dtype`.

    ``cfg.pretrained`` and ``cfg.lazy_load``: built on the meta device (buffers real), for
    `lazy_load.load_base_lazily` once the experts are split, so that a rank reads only its own;
    pretrained without lazy_load: transformers' ``from_pretrained`` of the whole model on this rank's CPU;
    otherwise random weights from `seed`, generated on `device` (seconds for 30 B parameters on a GPU, where
    the CPU's serial generator takes minutes): the same on every rank, so on a GPU the whole base must fit in
    its memory once (61 GB for a 30 B model in bf16) before the experts are split and the rest sharded.
    Logs (rank 0) how it was made and in how many seconds, and for a model with Mamba layers which
    implementation they run (`mamba_kernels`).
    """
    from accelerate import init_empty_weights

    torch.manual_seed(seed)  # same base (random init) on every rank and every EP degree
    started = time.perf_counter()
    if cfg.pretrained and cfg.lazy_load:
        with init_empty_weights(include_buffers=False):  # parameters on meta; buffers (rotary tables) real
            model, how = auto_class.from_config(hf_config, dtype=dtype), "built on the meta device"
    elif cfg.pretrained:
        model, how = (
            auto_class.from_pretrained(cfg.name_or_path, config=hf_config, dtype=dtype),
            "loaded whole on the CPU",
        )
    else:
        with torch.device(device):
            model, how = auto_class.from_config(hf_config, dtype=dtype), f"made (random init) on {device}"
    log = cookbook.get_logger()
    log.info(f"base model {how} in {time.perf_counter() - started:.1f} s")
    if (kernels := mamba_kernels(hf_config)) is not None:
        log.info(kernels)
    return model


# The packages whose kernels transformers' modeling code of a model type calls when they import
# (`transformers.integrations.hub_kernels.use_kernel_func_from_hub_with_fallback`), else its PyTorch path.
MAMBA_KERNEL_PACKAGES = {"nemotron_h": ("mamba_ssm", "causal_conv1d")}


def mamba_kernels(hf_config) -> str | None:
    """One line saying which implementation the Mamba-2 layers of `hf_config` run: the ``mamba_ssm`` /
    ``causal_conv1d`` kernels where the package imports, transformers' PyTorch reference path where it does
    not (correct, slower; transformers' own warning about it is below the recipes' log level). None for a model
    type without Mamba layers (`MAMBA_KERNEL_PACKAGES`). A package that is installed but fails to import (a
    CUDA extension built for another torch) counts as missing, as transformers counts it."""
    import importlib

    packages = MAMBA_KERNEL_PACKAGES.get(hf_config.get_text_config().model_type)
    if packages is None:
        return None
    found, missing = [], []
    for name in packages:
        try:
            importlib.import_module(name)
            found.append(name)
        except Exception as exc:  # noqa: BLE001 - ImportError, or a broken extension's OSError / RuntimeError
            missing.append(f"{name} ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
    line = f"Mamba-2 layers ({hf_config.get_text_config().model_type}): "
    line += f"kernels of {', '.join(found)}" if found else ""
    if missing:
        line += (
            ("; " if found else "") + f"not importable: {', '.join(missing)}: transformers runs its PyTorch path "
            "for those parts (correct, slower)"
        )
    return line


def active_flops(model: torch.nn.Module, hf_config, exclude: torch.nn.Module | None = None) -> ModelFlops:
    """FLOPs per token counting the parameters a token uses: all non-embedding parameters but those of
    `exclude` (a vision tower: it runs per image patch, not per token), except that a routed expert layer
    contributes top-k / E of its experts. Attention FLOPs for the attention layers only; Mamba's scan is not
    counted."""
    experts = moe_blocks(model)
    routed = sum(p.numel() for _, b in experts for p in b.experts.parameters())
    text = hf_config.get_text_config()
    frac = text.num_experts_per_tok / experts[0][1].experts.num_experts if experts else 0.0
    types = getattr(text, "layers_block_type", None) or ["full_attention"] * text.num_hidden_layers
    excluded = count_parameters(exclude) if exclude is not None else 0
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return ModelFlops(
        int(count_parameters(model) - excluded - routed * (1 - frac)),
        sum(t == "full_attention" for t in types),
        text.num_attention_heads * head_dim,
    )


def init_lora(model: torch.nn.Module, seed: int) -> list[torch.nn.Parameter]:
    """(Re-)initialise every LoRA factor with PEFT's own initialisation (A: Kaiming-uniform, B: 0) from `seed`,
    in module order, on CPU, in fp32 (the frozen base weights keep their dtype): the same initial adapter
    whatever the load path (a model built on the meta device gives PEFT meta base weights, and PEFT then leaves
    its factors on meta) and the EP degree.

    Returns:
        The trainable parameters.
    """
    from peft.tuners.lora.layer import LoraLayer

    torch.manual_seed(seed)
    for module in model.modules():
        if isinstance(module, LoraLayer):
            for adapter in module.lora_A:
                for layer in (module.lora_A[adapter], module.lora_B[adapter]):
                    if layer.weight.is_meta:
                        layer.to_empty(device="cpu")
                module.reset_lora_parameters(adapter, init_lora_weights=True)
    trainable = [p for p in model.parameters() if p.requires_grad]
    for p in trainable:
        p.data = p.data.float()
    return trainable


# ----------------------------------------------------------------------------- compile and activation checkpointing
COMPILE_BACKEND = (
    "inductor"  # `compile_parts`' default backend (the CPU tests set aot_eager: inductor's C++ build is slow)
)
_COMPILED_ROUTED: dict = {}  # backend -> torch.compile(routed_experts_forward), made once: every layer shares its code


def compile_parts(layers, part: str, backend=None) -> int:
    """``torch.compile`` parts of every decoder layer in place (module and parameter names unchanged):

    - ``moe``: each MoE block's router (``gate``, ``Module.compile``) and, where `use_routed_lora` set it, its
      experts' `routed_experts_forward`: routing (sort, offsets, gather, weights, unsort) and the grouped GEMMs,
      base and LoRA, in one graph (the GEMMs are the opaque `grouped_mm` operator). The experts module's own
      ``__call__`` (FSDP2's hooks) and, under EP, the all-to-all of `ep_dispatch` stay eager.
    - ``layers``: each decoder layer whole (``Module.compile``, as torchtitan does), before ``fully_shard``.

    Call after `use_routed_lora` and before `split_experts` (which wraps the experts' forward as it finds it) and
    ``fully_shard``. Every layer runs the same compiled code (parameters are graph inputs, not constants).
    `backend`: torch.compile's, a name or a callable; default `COMPILE_BACKEND` (``aot_eager`` traces forward and
    backward as inductor does, without generating code).

    Returns:
        The number of modules or forwards compiled. Raises ValueError for another `part`.
    """
    if part not in ("moe", "layers"):
        raise ValueError(f"part must be 'moe' or 'layers', got {part!r}")
    backend = backend or COMPILE_BACKEND
    count = 0
    for layer in layers:
        if part == "layers":
            layer.compile(backend=backend)
            count += 1
            continue
        for _, block in moe_blocks(layer):
            block.gate.compile(backend=backend)
            if getattr(block.experts.forward, "__func__", None) is routed_experts_forward:
                if backend not in _COMPILED_ROUTED:
                    _COMPILED_ROUTED[backend] = torch.compile(routed_experts_forward, backend=backend)
                block.experts.forward = partial(_COMPILED_ROUTED[backend], block.experts)
                count += 1
            count += 1
    return count


def checkpoint_parts(layers, part: str) -> int:
    """Recompute one part of every decoder layer in backward instead of keeping its activations: ``attention``
    (each module whose class name ends in ``Attention``) or ``experts`` (each MoE block: router and experts,
    with the EP all-to-all). Module names, and so parameter names, do not change (the modules' ``forward`` is
    wrapped in place). ``full`` (whole layers) is transformers' ``gradient_checkpointing_enable``.

    Returns:
        The number of modules wrapped. Raises ValueError for another `part`.
    """
    if part not in ("attention", "experts"):
        raise ValueError(f"part must be 'attention' or 'experts', got {part!r}")
    targets = []
    for layer in layers:
        if part == "experts":
            targets += [block for _, block in moe_blocks(layer)]
        else:
            targets += [m for m in layer.modules() if type(m).__name__.endswith("Attention")]
    return checkpoint_modules(targets)


# ----------------------------------------------------------------------------- router statistics
def token_mask(batch: dict[str, torch.Tensor], pad_id: int) -> torch.Tensor | None:
    """(B, L) bool: the tokens of a `cookbook.sft.collate` batch that are not padding, for `RouterStats.take`.
    Right-padded rows: the ``attention_mask``. Packed rows (``position_ids``, no mask): all but each row's
    trailing padding, the last document when it holds only `pad_id` (`cookbook.sft.pack`). None: neither key."""
    if "attention_mask" in batch:
        return batch["attention_mask"].bool()
    if "position_ids" not in batch:
        return None
    document = (batch["position_ids"] == 0).cumsum(1)
    last = document == document[:, -1:]
    padding = last & (~last | (batch["input_ids"] == pad_id)).all(1, keepdim=True)
    return ~padding


class RouterStats:
    """Forward hooks on the routers: the load-balancing loss and the expert loads of each forward.

    Each router's hook keeps its latest output on the router module itself (attribute ``router_record``), not in
    a list: under ``torch.compile`` (`compile_parts`) a hook appending to a shared list makes dynamo guard on the
    list's length, so every layer's call failed its guard and recompiled until dynamo's recompile limit (8) sent
    the remaining layers back to eager (measured on one H200, Qwen3-30B-A3B, ``train.compile=layers``). An
    attribute store has no such guard, and every layer runs the same compiled code.
    """

    ATTR = "router_record"

    def __init__(self, model: torch.nn.Module):
        self.blocks = moe_blocks(model)
        for _, block in self.blocks:
            setattr(block.gate, self.ATTR, None)
            block.gate.register_forward_hook(RouterStats._record)
        self.num_experts = self.blocks[0][1].gate.num_experts if self.blocks else 0
        self.sigmoid = bool(self.blocks) and hasattr(self.blocks[0][1].gate, "e_score_correction_bias")
        self.loads = torch.zeros(len(self.blocks), self.num_experts, dtype=torch.float64)

    @staticmethod
    def _record(module: torch.nn.Module, inputs, out) -> None:
        """Forward hook: keep the router's logits (tokens, experts) and chosen experts (tokens, top_k)."""
        setattr(module, RouterStats.ATTR, (out[0], out[2]))

    def drop(self) -> None:
        """Forget the routers' records without counting them: those of a recomputing backward (activation
        checkpointing repeats each forward) or of evaluation forwards."""
        for _, block in self.blocks:
            setattr(block.gate, self.ATTR, None)

    def take(self, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Mean Switch-Transformer aux loss over this forward's MoE layers (Fedus et al. 2021, "Switch
        Transformers", eq. 4): E * sum_e f_e * P_e, f_e the share of routed slots that chose expert e, P_e the mean
        router probability of e (sigmoid routers normalised per token); adds the loads, then forgets the records.

        Args:
            mask: the tokens to count, (B, L) of the forward's batch (`token_mask`: padding left out); None: all.

        Returns:
            A 0-dim float32 tensor (zero when no router ran since the last `take` / `drop`, or no token is
            counted), differentiable through the router logits. Computed for all layers at once (one set of
            kernels, not one per layer). Raises ValueError when `mask` does not have one entry per routed token.
        """
        records = [getattr(block.gate, self.ATTR) for _, block in self.blocks]
        self.drop()
        kept = [(i, r) for i, r in enumerate(records) if r is not None]
        if not kept:
            return torch.zeros(())
        layers = [i for i, _ in kept]
        logits = torch.stack([r[0] for _, r in kept]).float()  # (layers, tokens, experts)
        idx = torch.stack([r[1] for _, r in kept])  # (layers, tokens, top_k)
        probs = logits.sigmoid() if self.sigmoid else logits.softmax(-1)
        probs = probs / probs.sum(-1, keepdim=True)
        n, e = len(kept), self.num_experts
        if mask is None:
            slots, mean_probs = torch.ones(idx.numel(), dtype=probs.dtype, device=probs.device), probs.mean(1)
        else:
            if mask.numel() != idx.shape[1]:
                raise ValueError(f"mask has {mask.numel()} entries for {idx.shape[1]} routed tokens")
            w = mask.reshape(-1).to(device=probs.device, dtype=probs.dtype)
            slots = w[None, :, None].expand(idx.shape).reshape(-1)  # each (layer, token, k) slot weighs as its token
            mean_probs = (probs * w[:, None]).sum(1) / w.sum().clamp(min=1)
        # counts per (layer, expert) with one scatter_add (not bincount: on CUDA it waits for the host to learn
        # its max); the layer offset l * E makes one flat index space of n * E bins
        flat = (idx.reshape(n, -1) + torch.arange(n, device=idx.device).unsqueeze(1) * e).reshape(-1)
        counts = torch.zeros(n * e, dtype=probs.dtype, device=probs.device).scatter_add_(0, flat, slots).reshape(n, e)
        if self.loads.device != counts.device:  # kept on the device: no copy to the host (a wait) per step
            self.loads = self.loads.to(counts.device)
        self.loads.index_add_(0, torch.tensor(layers, device=counts.device), counts.detach().double())
        losses = e * (counts / counts.sum(-1, keepdim=True).clamp(min=1) * mean_probs).sum(-1)
        return losses.mean()

    def load_metrics(self, ep: int, device: torch.device) -> dict[str, float]:
        """Load balance over the window (all ranks), then reset: ``moe/load_max_over_mean`` (busiest expert / mean,
        mean over layers) and ``moe/ep_rank_load_max_over_mean`` (busiest EP rank / mean). Collective."""
        if not self.blocks:
            return {}
        loads = self.loads.to(device, copy=True)
        if dist.is_initialized():
            dist.all_reduce(loads)
        self.loads.zero_()
        mean = loads.mean(1).clamp(min=1.0)
        per_rank = loads.reshape(len(self.blocks), ep, -1).sum(-1)
        return {
            "moe/load_max_over_mean": (loads.max(1).values / mean).mean().item(),
            "moe/ep_rank_load_max_over_mean": (per_rank.max(1).values / per_rank.mean(1).clamp(min=1.0)).mean().item(),
        }


def evaluate(model: torch.nn.Module, loader, device: torch.device, router: RouterStats) -> dict[str, float]:
    """`cookbook.sft.evaluate` (mean loss per labelled token over the evaluation rows of every rank) on a MoE model:
    the routers' records of the evaluation forwards are dropped uncounted (`RouterStats.drop`), so the loads
    logged for training are those of training. Collective."""
    from cookbook.sft import evaluate as sft_evaluate

    return sft_evaluate(model, loader, device, on_batch=lambda batch: router.drop())
