"""Which data-parallel technique fits? Peak GPU memory per GPU of DDP, FSDP2 and DeepSpeed ZeRO for a
transformer, with the arithmetic shown, and the simplest technique that fits with some headroom.

    python scripts/choose_technique.py Qwen/Qwen3-8B --gpus 2 --gpu-mem-gib 141 --seq 2048 --micro-batch 4
    python scripts/choose_technique.py path/to/config.json --gpus 8 --gpu-mem-gib 80 --seq 4096 --micro-batch 1
    python scripts/choose_technique.py path/to/config.json --gpus 2 --gpu-mem-gib 141 --seq 2048 --micro-batch 4 \\
        --compile --loss chunked          # per-layer torch.compile; cookbook's chunked loss (recipes/qwen-fsdp2-sft)
    python scripts/choose_technique.py openai/gpt-oss-120b --gpus 4 --gpu-mem-gib 139 --seq 2048 --micro-batch 2 \\
        --lora --lora-r 16 --lora-targets q_proj,k_proj,v_proj,o_proj   # LoRA rows (recipes/gpt-oss-lora-trl)

MODEL is a ``config.json`` (or a folder holding one) or a Hugging Face hub id (read with
``transformers.AutoConfig`` when the hub is reachable). Nothing is downloaded but the config.

Assumptions (what the numbers are of):
    - bf16 compute, fp32 master weights, fp32 AdamW moments; peak *allocated* memory as
      ``torch.cuda.max_memory_allocated`` reports it (the caching allocator reserves more:
      5-25% in our benchmarks, hence the headroom).
    - DDP as in ``recipes/modernbert-ddp``: fp32 model, bf16 autocast, DDP gradient buckets
      (``gradient_as_bucket_view=False``, the default).
    - FSDP2 as in ``recipes/qwen-fsdp2-sft``: fp32 sharded parameters, bf16 all-gathered
      parameters, fp32 gradient reduce-scatter, ``fully_shard`` per decoder layer and on the root.
    - DeepSpeed ZeRO with ``bf16.enabled``: bf16 parameters and gradients, fp32 master copy and
      AdamW moments partitioned by stage; library-default bucket sizes.
    - Attention by a FlashAttention-style kernel (flash, memory-efficient SDPA, varlen): no
      sequence x sequence matrix is kept. Eager attention would add 2 x heads x seq bytes per token
      per layer (Korthikanti et al. 2022, eq. (1), the 5as/h term).
    - Activation checkpointing ("AC") is full, per decoder layer; "selective AC" is the FSDP2
      recipe's policy (each layer keeps its input and the outputs of its matmuls and of the
      attention kernel, and recomputes the rest); no dropout; no tensor or sequence parallelism;
      gradient accumulation does not change the peak.
    - Loss (``--loss``): ``full`` fp32 logits of the whole micro-batch; ``chunked`` the FSDP2
      recipe's ``train.loss=chunked`` (``cookbook.sft.linear_cross_entropy_sum``, ``--loss-chunk``
      tokens at a time); ``fused`` a tiled loss that keeps no logits (TRL's ``SFTTrainer``, as in
      ``recipes/qwen-zero3-receipts``). A row whose recipe has not the loss asked for (chunked: only
      the FSDP2 rows; fused: only the ZeRO rows) is counted with the full logits, and the output says so.
    - Mixture of experts (``num_local_experts`` / ``num_experts`` / ``n_routed_experts`` with
      ``num_experts_per_tok``): the parameters count every expert, the activations ``top_k``
      routed copies of each token (`moe_fields`, `activation_bytes_per_token_layer`); gpt_oss's
      clamped SwiGLU and attention sinks are modelled. Not modelled: ``--compile`` with MoE, models
      mixing dense and MoE layers.

LoRA (``--lora``, ``--lora-r``, ``--lora-targets``): the rows of ``recipes/gpt-oss-lora-trl``
(``parallel=ddp`` or ``fsdp``, ``train.activation_checkpointing=none`` or ``full``) in place of the
table above. The base is frozen and held in bf16 (2 B per parameter: DDP a whole copy per GPU,
FSDP2 a 1/N shard plus the gathered layers and the gathered output head); only the adapters have
fp32 weights, gradients and AdamW moments (`lora_state_bytes`). Activations: the frozen base still
passes activation gradients back, but a frozen matmul keeps none of its inputs; what autograd keeps
is in `lora_activation_bytes_per_token_layer`. The loss
defaults to ``fused``: TRL's ``SFTTrainer`` (1.16) computes it with its fused LM head (no logits
kept); ``--loss full`` counts the full fp32 logits of an older TRL. The LoRA rows against
1-H200 peaks of gpt_oss 20B (r 16 on q/k/v/o, 4,096 tokens): DDP 60.2 GiB estimated / 60.6
measured, DDP + AC 40.6 / 41.0, DDP micro-batch 2 81.3 / 82.0, FSDP2 + AC 43.1 / 42.5
(tests/test_choose_technique.py). ZeRO with LoRA is not modelled.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

GIB = 2**30

# DeepSpeed defaults (deepspeed/runtime/zero/config.py, 0.19): reduce_bucket_size 5e8 elements
# (one bf16 buffer with contiguous_gradients), sub_group_size 1e9 elements (ZeRO-3 steps the
# optimizer one sub-group at a time, with an fp32 copy of that sub-group's gradients).
DS_REDUCE_BUCKET = 500_000_000
DS_SUB_GROUP = 1_000_000_000

# Model families whose attention projections carry biases without an ``attention_bias`` field.
QKV_BIAS_TYPES = {"qwen2", "qwen2_moe"}


class ChooserError(ValueError):
    """A bad input: the message says what to change."""


@dataclass(frozen=True)
class ModelShape:
    """What the memory estimate needs to know about a model.

    Attributes:
        name: where it came from (path or hub id).
        params: all parameters, tied ones counted once.
        embed_params: input embedding parameters.
        head_params: output projection parameters that are not tied to the embedding (0 if tied).
        layer_params: parameters of the largest transformer layer.
        layers: number of transformer layers.
        hidden: hidden size h.
        q_dim: query heads x head dim.
        kv_dim: key/value heads x head dim (smaller than q_dim with GQA / MQA).
        ffn: MLP intermediate size f.
        gated: MLP with a gate (SwiGLU / GeGLU: three h x f matrices) rather than two.
        qk_norm: per-head RMSNorm of queries and keys (Qwen3, OLMo 2).
        vocab: vocabulary size.
        lm_head: the model produces logits over the vocabulary for every token.
        counted_by: "meta device" (transformers, exact) or "config fields" (formula).
        experts: routed experts per mixture-of-experts (MoE) layer (0: a dense MLP); ``ffn`` is then
            the intermediate size of one expert.
        top_k: experts each token is routed to (``num_experts_per_tok``).
        shared_ffn: intermediate size of the shared experts every token also goes through (0: none).
        heads: attention (query) heads.
        sinks: attention sinks (a learned logit per head in the softmax's denominator: gpt_oss).
        model_type: the config's ``model_type``.
    """

    name: str
    params: int
    embed_params: int
    head_params: int
    layer_params: int
    layers: int
    hidden: int
    q_dim: int
    kv_dim: int
    ffn: int
    gated: bool
    qk_norm: bool
    vocab: int
    lm_head: bool
    counted_by: str
    experts: int = 0
    top_k: int = 0
    shared_ffn: int = 0
    heads: int = 0
    sinks: bool = False
    model_type: str = ""


# ----------------------------------------------------------------------------- the model
def load_config(model: str) -> dict:
    """The model's config as a dict: from a ``config.json`` path, a folder holding one, or a hub id
    (``transformers.AutoConfig``, which needs the hub or its cache). Raises `ChooserError`."""
    path = Path(model).expanduser()
    looks_local = (
        path.suffix == ".json" or model.startswith((".", "/", "~")) or path.parent.is_dir() and path.parent != Path(".")
    )
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ChooserError(f"{path}: not a JSON config ({exc})") from None
    elif looks_local:
        raise ChooserError(f"{model}: no such config file (give a config.json, a folder holding one, or a hub id)")
    else:
        try:
            from transformers import AutoConfig

            from cookbook.hub import offline_unless_reachable

            offline_unless_reachable()  # no hub: the cache at once, not ~25 s of retries
            cfg = AutoConfig.from_pretrained(model).to_dict()
        except Exception as exc:  # noqa: BLE001  offline, unknown id, gated repo: one sentence
            raise ChooserError(
                f"{model}: not a local config file and not loadable from the hub "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
            ) from None
    cfg = cfg.get("text_config", cfg) if "num_hidden_layers" not in cfg else cfg
    if not isinstance(cfg, dict) or "hidden_size" not in cfg or "num_hidden_layers" not in cfg:
        raise ChooserError(f"{model}: the config has no hidden_size / num_hidden_layers: not a transformer config")
    return cfg


def _dims(cfg: dict) -> tuple[int, int, int, int, int, int]:
    h, layers = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    heads = int(cfg.get("num_attention_heads", 1))
    head_dim = int(cfg.get("head_dim") or h // heads)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    ffn = int(cfg.get("intermediate_size") or 4 * h)
    return h, layers, heads * head_dim, kv_heads * head_dim, ffn, head_dim


def moe_fields(cfg: dict) -> tuple[int, int, int, int]:
    """``(experts, top_k, expert_ffn, shared_ffn)`` of a mixture-of-experts config; ``experts`` is 0
    for a dense model. Field names: ``num_local_experts`` (gpt_oss, Mixtral), ``num_experts``
    (Qwen2/3-MoE) or ``n_routed_experts`` (DeepSeek); ``num_experts_per_tok``; the expert width
    ``moe_intermediate_size``, else ``intermediate_size`` (gpt_oss and Mixtral: each expert's);
    shared experts ``shared_expert_intermediate_size`` or ``n_shared_experts`` x the expert width.

    Raises:
        ChooserError: routed experts without ``num_experts_per_tok``, or dense and MoE layers mixed
            (``mlp_only_layers``, ``decoder_sparse_step`` > 1, ``first_k_dense_replace``), which the
            per-layer arithmetic does not model.
    """
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0)
    if not experts:
        return 0, 0, 0, 0
    if not cfg.get("num_experts_per_tok"):
        raise ChooserError(f"the config has {experts} experts but no num_experts_per_tok")
    if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step") or 1) > 1 or cfg.get("first_k_dense_replace"):
        raise ChooserError(
            "dense and MoE layers mixed (mlp_only_layers / decoder_sparse_step / first_k_dense_replace): not modelled"
        )
    f = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) or int(cfg.get("n_shared_experts") or 0) * f
    return experts, int(cfg["num_experts_per_tok"]), f, shared


def shape_from_fields(cfg: dict, name: str = "config") -> ModelShape:
    """Parameter count of a Llama-style decoder (GQA attention, gated MLP, RMSNorm) from its
    config fields: embedding V·h; per layer h·q + 2·h·kv + q·h (attention) + 3·h·f (gated MLP)
    + 2·h (norms) + 2·head_dim (q/k norms, Qwen3) + q + 2·kv (biases, Qwen2 or
    ``attention_bias``); final norm h; an untied head V·h.
    Mixture of experts (`moe_fields`): the MLP is a router E·h and E experts of 3·h·f each, plus
    shared experts 3·h·f_shared (and Qwen2-MoE's h-wide shared-expert gate); gpt_oss adds the
    router bias E, the expert biases E·(2f + h) and one attention sink per head.

    Exact for Llama, Mistral, Qwen2/2.5/3 dense, Mixtral, Qwen3-MoE and gpt_oss; other
    architectures need `shape_from_meta`.
    """
    h, layers, q, kv, f, head_dim = _dims(cfg)
    experts, top_k, f_expert, shared = moe_fields(cfg)
    kind = cfg.get("model_type", "")
    heads = int(cfg.get("num_attention_heads", 1))
    vocab = int(cfg["vocab_size"])
    qk_norm = kind in ("qwen3", "olmo2", "qwen3_moe")
    bias = q + 2 * kv if (cfg.get("attention_bias") or kind in QKV_BIAS_TYPES) else 0
    if cfg.get("attention_bias"):
        bias += h  # o_proj bias too
    if experts:
        f = f_expert
        mlp = experts * h + experts * 3 * h * f + 3 * h * shared + (h if kind == "qwen2_moe" and shared else 0)
        if kind == "gpt_oss":  # router bias, gate_up / down biases per expert, attention sinks
            mlp += experts + experts * (2 * f + h) + heads
    else:
        mlp = 3 * h * f
    layer = h * q + 2 * h * kv + q * h + mlp + 2 * h + (2 * head_dim if qk_norm else 0) + bias
    embed = vocab * h
    head = 0 if cfg.get("tie_word_embeddings", False) else vocab * h
    return ModelShape(
        name,
        embed + head + layers * layer + h,
        embed,
        head,
        layer,
        layers,
        h,
        q,
        kv,
        f,
        True,
        qk_norm,
        vocab,
        True,
        "config fields",
        experts,
        top_k,
        shared,
        heads,
        kind == "gpt_oss",
        kind,
    )


def shape_from_meta(cfg: dict, name: str = "config") -> ModelShape:
    """Exact parameter count: the model built by transformers on the meta device (no memory, no
    weights), with the class named in ``architectures`` (else ``AutoModelForCausalLM``, else
    ``AutoModel``). Tied parameters are counted once."""
    import torch
    import transformers

    if "model_type" not in cfg:
        raise ChooserError(f"{name}: the config has no model_type: transformers cannot build it (try --no-meta)")
    config = transformers.AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})
    archs = [getattr(transformers, a, None) for a in cfg.get("architectures") or []]
    builders = [a for a in archs if a is not None] + [transformers.AutoModelForCausalLM, transformers.AutoModel]
    model, errors = None, []
    with torch.device("meta"):
        for b in builders:
            try:
                model = b.from_config(config) if b.__name__.startswith("Auto") else b(config)
                break
            except Exception as exc:  # noqa: BLE001  try the next class; all errors are reported
                errors.append(f"{b.__name__}: {exc}")
    if model is None:
        raise ChooserError(f"{name}: transformers could not build the model: {'; '.join(errors)[:300]}")
    h, layers, q, kv, f, _ = _dims(cfg)
    experts, top_k, f_expert, shared = moe_fields(cfg)
    f = f_expert if experts else f
    params = sum(p.numel() for p in model.parameters())
    embed_mod = model.get_input_embeddings()
    embed = embed_mod.weight.numel() if embed_mod is not None else 0
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head = out.weight.numel() if out is not None and out.weight is not getattr(embed_mod, "weight", None) else 0
    stacks = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == layers]
    if not stacks:
        raise ChooserError(f"{name}: found no list of {layers} layers in {type(model).__name__}")
    layer = max(sum(p.numel() for p in blk.parameters()) for blk in stacks[0])
    names = {n.split(".")[-2] for n, _ in stacks[0][0].named_parameters() if "." in n}
    mlp = layer - (h * q + 2 * h * kv + q * h)
    gated = experts > 0 or (round(mlp / (h * f)) >= 3 if f else True)
    vocab = int(cfg.get("vocab_size") or 0)
    lm_head = out is not None and out.weight.shape[0] == vocab
    sinks = any(n.split(".")[-1] == "sinks" for n, _ in stacks[0][0].named_parameters())
    return ModelShape(
        name,
        params,
        embed,
        head,
        layer,
        layers,
        h,
        q,
        kv,
        f,
        gated,
        bool(names & {"q_norm", "k_norm"}),
        vocab,
        lm_head,
        f"meta device ({type(model).__name__})",
        experts,
        top_k,
        shared,
        int(cfg.get("num_attention_heads", 1)),
        sinks,
        cfg.get("model_type", ""),
    )


def model_shape(model: str, meta: bool = True) -> ModelShape:
    """`shape_from_meta` when transformers can build the model, else `shape_from_fields`."""
    cfg = load_config(model)
    if meta:
        try:
            return shape_from_meta(cfg, model)
        except ImportError:
            pass
    return shape_from_fields(cfg, model)


# ----------------------------------------------------------------------------- the arithmetic
@dataclass(frozen=True)
class Technique:
    """One way to train. ``zero``: DeepSpeed ZeRO stage (0 for the native PyTorch ones);
    ``fsdp``: FSDP2; ``ac``: full activation checkpointing per layer; ``sac``: selective activation
    checkpointing per layer (`selective_bytes_per_token_layer`); ``offload``: FSDP2's
    ``CPUOffloadPolicy`` (parameters, gradients and optimizer state in host memory); ``losses``: the
    ``--loss`` choices its recipe has (`logits_bytes`); any other is counted as ``full``; ``lora``: a
    LoRA fine-tune of a frozen bf16 base (`LoraSpec`, `lora_state_bytes`)."""

    name: str
    zero: int = 0
    fsdp: bool = False
    ac: bool = False
    sac: bool = False
    offload: bool = False
    losses: tuple[str, ...] = ("full",)
    lora: bool = False

    @property
    def recipe(self) -> str:
        """The cookbook recipe whose set-up the row's arithmetic follows (DDP: the decoder one, `recipe_for`)."""
        if self.lora:
            return "recipes/gpt-oss-lora-trl"
        return (
            "recipes/qwen-fsdp2-sft"
            if self.fsdp
            else "recipes/qwen-zero3-receipts"
            if self.zero
            else "recipes/qwen-ray-sft"
        )

    def recipe_for(self, m: ModelShape) -> str:
        """`recipe` for model `m`: DDP of a model without a vocabulary head (an encoder classifier) is
        ``recipes/modernbert-ddp``; of a decoder (a causal LM), the DDP SFT recipe ``recipes/qwen-ray-sft``."""
        return "recipes/modernbert-ddp" if self.name == "DDP" and not m.lm_head else self.recipe

    def loss_for(self, loss: str) -> str:
        """The loss this row is counted with: `loss` if its recipe has it, else ``full``."""
        return loss if loss in self.losses else "full"


FSDP2_LOSSES = ("full", "chunked")  # recipes/qwen-fsdp2-sft: train.loss
ZERO_LOSSES = ("full", "fused")  # recipes/qwen-zero3-receipts: TRL's SFTTrainer, fused LM head
TECHNIQUES = [
    Technique("DDP"),
    Technique("FSDP2", fsdp=True, losses=FSDP2_LOSSES),
    Technique("FSDP2 + selective AC", fsdp=True, sac=True, losses=FSDP2_LOSSES),
    Technique("FSDP2 + AC", fsdp=True, ac=True, losses=FSDP2_LOSSES),
    Technique("FSDP2 + AC + CPU offload", fsdp=True, ac=True, offload=True, losses=FSDP2_LOSSES),
    Technique("ZeRO-1", zero=1, losses=ZERO_LOSSES),
    Technique("ZeRO-2", zero=2, losses=ZERO_LOSSES),
    Technique("ZeRO-3", zero=3, losses=ZERO_LOSSES),
    Technique("ZeRO-1 + AC", zero=1, ac=True, losses=ZERO_LOSSES),
    Technique("ZeRO-2 + AC", zero=2, ac=True, losses=ZERO_LOSSES),
    Technique("ZeRO-3 + AC", zero=3, ac=True, losses=ZERO_LOSSES),
]
# The order a recommendation tries them: fewer moving parts first.
NATIVE_ORDER = ["DDP", "FSDP2", "FSDP2 + selective AC", "FSDP2 + AC", "FSDP2 + AC + CPU offload"]
ZERO_ORDER = ["ZeRO-1", "ZeRO-2", "ZeRO-3", "ZeRO-1 + AC", "ZeRO-2 + AC", "ZeRO-3 + AC"]
# --lora: recipes/gpt-oss-lora-trl (parallel=ddp|fsdp, train.activation_checkpointing=none|full; TRL's
# SFTTrainer, whose loss is its fused LM head, or the full logits with an older TRL)
LORA_LOSSES = ("fused", "full")
LORA_TECHNIQUES = [
    Technique("LoRA DDP", losses=LORA_LOSSES, lora=True),
    Technique("LoRA DDP + AC", ac=True, losses=LORA_LOSSES, lora=True),
    Technique("LoRA FSDP2", fsdp=True, losses=LORA_LOSSES, lora=True),
    Technique("LoRA FSDP2 + AC", fsdp=True, ac=True, losses=LORA_LOSSES, lora=True),
]
LORA_ORDER = [t.name for t in LORA_TECHNIQUES]
# LoRA target modules: (input width, output width) in terms of the model's dims
LORA_DIMS = {
    "q_proj": ("h", "q"),
    "k_proj": ("h", "kv"),
    "v_proj": ("h", "kv"),
    "o_proj": ("q", "h"),
    "gate_proj": ("h", "f"),
    "up_proj": ("h", "f"),
    "down_proj": ("f", "h"),
}


@dataclass(frozen=True)
class LoraSpec:
    """LoRA adapters (PEFT ``LoraConfig``): rank ``r`` on the modules named in ``targets`` (each a key
    of `LORA_DIMS`) of every layer. A target of input width i and output width o adds r·(i + o)
    parameters (A: r x i, B: o x r)."""

    r: int
    targets: tuple[str, ...]

    def layer_params(self, m: ModelShape) -> int:
        """Adapter parameters per layer: sum of r·(in + out) over the targets.

        Raises:
            ChooserError: an unknown target, a non-positive rank, or MLP targets on a MoE model (its
                experts are parameters, not ``nn.Linear`` modules: PEFT's ``target_parameters``,
                which the chooser does not count).
        """
        if self.r < 1:
            raise ChooserError(f"--lora-r must be a positive rank, got {self.r}")
        unknown = [t for t in self.targets if t not in LORA_DIMS]
        if unknown or not self.targets:
            raise ChooserError(f"--lora-targets: {', '.join(unknown) or 'none given'}; known: {', '.join(LORA_DIMS)}")
        if m.experts and set(self.targets) & {"gate_proj", "up_proj", "down_proj"}:
            raise ChooserError(
                "--lora-targets: MLP modules of a mixture-of-experts model are not modelled "
                "(expert LoRA goes through PEFT's target_parameters)"
            )
        width = {"h": m.hidden, "q": m.q_dim, "kv": m.kv_dim, "f": m.ffn}
        return sum(self.r * (width[LORA_DIMS[t][0]] + width[LORA_DIMS[t][1]]) for t in self.targets)

    def params(self, m: ModelShape) -> int:
        """All adapter parameters: `layer_params` x layers."""
        return self.layer_params(m) * m.layers


def bytes_per_param(t: Technique, gpus: int) -> tuple[float, str]:
    """Bytes of model state per parameter held on each GPU for the whole run, and where it comes from.

    ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
    Models", section 3.1 and figure 1): 2 (bf16 weights) + 2 (bf16 gradients) + K = 12 (fp32 master
    weights, AdamW m and v); stage 1 splits the 12 over N GPUs, stage 2 also the gradients, stage
    3 everything: 2 + 2 + 12/N, 2 + 14/N, 16/N.
    FSDP2 with fp32 sharded parameters: 4 (fp32 weights) + 4 (fp32 gradients) + 8 (AdamW), all
    over N: 16/N (the bf16 copies are gathered layer by layer: see `working_bytes`).
    DDP with bf16 autocast: 4 (fp32 weights) + 4 (fp32 gradients) + 4 (DDP's gradient buckets,
    a second copy unless ``gradient_as_bucket_view=True``: PyTorch DDP documentation) + 8 (AdamW)
    + 2 (autocast's cache of bf16 weight copies, kept from forward to backward) = 22.
    CPU offload: 0 on the GPU (the 16/N live in host memory).
    """
    n = gpus
    if t.offload:
        return 0.0, "0: fp32 weights, gradients and AdamW state in host memory (16/N bytes there)"
    if t.fsdp:
        return 16 / n, f"(4 fp32 weights + 4 fp32 grads + 8 AdamW) / {n} [recipe's FSDP2 mixed precision]"
    if t.zero == 1:
        return 2 + 2 + 12 / n, f"2 bf16 weights + 2 bf16 grads + 12 / {n} [ZeRO paper fig. 1, P_os]"
    if t.zero == 2:
        return 2 + 14 / n, f"2 bf16 weights + (2 bf16 grads + 12) / {n} [ZeRO paper fig. 1, P_os+g]"
    if t.zero == 3:
        return 16 / n, f"(2 + 2 + 12) / {n} [ZeRO paper fig. 1, P_os+g+p]"
    return 22.0, "4 fp32 weights + 4 fp32 grads + 4 DDP buckets + 8 AdamW + 2 autocast bf16 cache"


def lora_state_bytes(t: Technique, m: ModelShape, lora: LoraSpec, gpus: int) -> tuple[float, str]:
    """Bytes of model state on each GPU for the whole run of a LoRA row, and where they come from.

    The base is frozen and held in bf16 (``recipes/gpt-oss-lora-trl``: the Trainer with ``bf16``
    loads it in bf16), with no gradient and no optimizer state: 2 B per base parameter. The
    adapters are fp32 (PEFT's ``autocast_adapter_dtype``; accelerate's FSDP2 preparation upcasts
    trainable parameters to fp32 too) with fp32 gradients and AdamW moments: DDP 22 B per adapter
    parameter as for a full DDP fine-tune (`bytes_per_param`), FSDP2 16 B.
    DDP: 2·P + 22·P_lora; FSDP2: (2·P + 16·P_lora) / N (the gathered layers: `working_bytes`).
    """
    n_lora = lora.params(m)
    if t.fsdp:
        return (
            (2 * m.params + 16 * n_lora) / gpus,
            f"(2 B x {m.params:,} bf16 frozen base + 16 B x {n_lora:,} fp32 adapters with grads and AdamW) / {gpus}",
        )
    return (
        2.0 * m.params + 22 * n_lora,
        f"2 B x {m.params:,} bf16 frozen base + 22 B x {n_lora:,} adapters (fp32 weights, grads, DDP buckets, "
        f"AdamW; bf16 autocast copies)",
    )


def lora_activation_bytes_per_token_layer(m: ModelShape, lora: LoraSpec, bf16_adapters: bool = False) -> dict[str, int]:
    """Bytes that autograd keeps per token per layer for the backward of a LoRA fine-tune (no AC, eager).

    The frozen base still needs activation gradients (the adapters sit inside every layer), but
    autograd saves a matmul's input only to compute its weight's gradient (PyTorch saves each
    input of ``mm`` / ``grouped_mm`` only if the other one requires grad), so the frozen
    projections keep nothing of their inputs; what is kept:
      - each RMSNorm: its fp32 upcast input (4h; the normalised tensor is not kept: the weight is frozen);
      - each LoRA target: its input (2 B x in width) for the gradient of A, and A's output (2r) for B.
        The adapters are fp32, so PEFT casts the input to fp32 and autocast casts it back, a
        separate bf16 copy per target (q, k and v: three copies of the same 2h); under FSDP2,
        whose ``param_dtype`` gathers the adapters in bf16 (``bf16_adapters``), one copy is shared;
      - the attention kernel (flash / flex): q, k, v, output and its fp32 log-sum-exp (4 x heads);
        gpt_oss's attention sinks renormalise the output with the log-sum-exp (16 x heads more);
      - a dense MLP that is not a target: gated 6f (the activation's input and output, the up
        projection), plain 2f (the activation's input);
      - MoE: per routed token (top_k per token) the expert's gate/up output (4f), the gate's
        pointwise results (gpt_oss's clamped SwiGLU: 4 x 2f; act(gate)·up: 2f) and the expert's
        output before the routing weight (2h), and its routing indices and weights (36 B);
        shared experts as a dense gated MLP.
    The totals are checked against measured peaks (``tests/test_choose_technique.py``), not tensor by tensor.

    Returns:
        item -> bytes per token per layer; their sum is the layer's total.
    """
    h, q, kv, f, r = m.hidden, m.q_dim, m.kv_dim, m.ffn, lora.r
    width = {"h": h, "q": q, "kv": kv, "f": f}
    out = {"2 norms: fp32 upcast input (4h each)": 8 * h}
    if m.qk_norm:
        out["q/k norms: fp32 inputs (4q + 4kv)"] = 4 * q + 4 * kv
    kept, copies = 0, []
    for group in (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",)):
        hit = [x for x in group if x in lora.targets]
        if hit:
            n = 1 if bf16_adapters else len(hit)
            kept += n * 2 * width[LORA_DIMS[hit[0]][0]]
            copies.append(f"{'+'.join(x.removesuffix('_proj') for x in hit)}: {n} x 2 x {width[LORA_DIMS[hit[0]][0]]}")
    kept += 2 * r * len(lora.targets)
    out[f"LoRA inputs ({'; '.join(copies)}) + A outputs (2r x {len(lora.targets)})"] = kept
    out["attention kernel: q, k, v, output (4q + 4kv) + fp32 log-sum-exp (4 x heads)"] = 4 * q + 4 * kv + 4 * m.heads
    if m.sinks:
        out["attention sinks: renormalisation (16 x heads)"] = 16 * m.heads
    if m.experts:
        gate = 12 * f if m.model_type == "gpt_oss" else 6 * f
        what = "4f gate/up + 4 x 2f clamped SwiGLU" if m.model_type == "gpt_oss" else "4f gate/up + 2f act"
        out[f"MoE, {m.top_k} experts per token x ({what} + 2h output + 36 B routing)"] = m.top_k * (gate + 2 * h + 36)
        if m.shared_ffn:
            out["shared experts: gated MLP (6 x f_shared)"] = 6 * m.shared_ffn
    else:
        out["MLP: " + ("gated, activation input/output + up (6f)" if m.gated else "activation input (2f)")] = (
            6 * f if m.gated else 2 * f
        )
    return out


def activation_bytes_per_token_layer(m: ModelShape, compiled: bool = False) -> dict[str, int]:
    """Bytes that autograd keeps per token per transformer layer for the backward pass (bf16, no AC).

    The bookkeeping of Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    Transformer Models", section 4.1 and eq. (1) (34·s·b·h + 5·a·s²·b per layer: every tensor an
    operation saves for its backward, 2 bytes per element), redone for today's layers:
      - no dropout (their 2 masks go), FlashAttention-style kernels (their 5·a·s²·b goes: the
        kernel keeps q, k, v, its output and a per-row log-sum-exp);
      - GQA: k and v are kv_dim wide, not h;
      - a gated MLP (SwiGLU / GeGLU) of width f instead of GeLU of width 4h;
      - RMSNorm as Hugging Face writes it: upcast to fp32, so each norm keeps its fp32 input (4h),
        the normalised bf16 tensor (2h) and its output for the next matmul (2h);
      - Qwen3-style q/k norms: 6 bytes per q or kv element, for the same reason.
    With ``compiled`` (``torch.compile`` of each layer), Inductor fuses the pointwise ops and
    recomputes them in the backward: what stays is the bf16 input and output of each norm, the
    q/k projections before their norms, the attention's q, k, v and output, and the gated MLP's
    two projections (its product is recomputed).

    MoE (``m.experts``): the MLP is top_k experts per token, each keeping its gathered input (2h),
    its gate/up output and gate (as in `lora_activation_bytes_per_token_layer`), its down projection's
    input (2f) and its output before the routing weight (2h); shared experts as a gated MLP;
    gpt_oss's attention sinks add 16 bytes per head. ``compiled`` is not modelled for MoE.

    Returns:
        item -> bytes per token per layer; their sum is the layer's total.

    Raises:
        ChooserError: ``compiled`` with a MoE model.
    """
    h, q, kv, f = m.hidden, m.q_dim, m.kv_dim, m.ffn
    if compiled and m.experts:
        raise ChooserError("--compile with a mixture-of-experts model is not modelled")
    if compiled:
        out = {"2 norms: bf16 input + output (2h + 2h each)": 8 * h}
        if m.qk_norm:
            out["q/k projections before their norms (2q + 2kv)"] = 2 * q + 2 * kv
        out["attention: q, k, v, output (2q + 2kv + 2kv + 2q)"] = 4 * q + 4 * kv
        out["MLP: " + ("gate and up projections (2f + 2f)" if m.gated else "activation input (2f)")] = (
            4 * f if m.gated else 2 * f
        )
        return out
    out = {"2 norms, fp32 upcast: 4h fp32 input + 2h normalised + 2h output, each": 16 * h}
    if m.qk_norm:
        out["q/k norms (6q + 6kv)"] = 6 * q + 6 * kv
    out["attention: q, k, v, output (2q + 2kv + 2kv + 2q)"] = 4 * q + 4 * kv
    if m.sinks:
        out["attention sinks: renormalisation (16 x heads)"] = 16 * m.heads
    if m.experts:
        gate = 12 * f if m.model_type == "gpt_oss" else 6 * f
        out[
            f"MoE, {m.top_k} experts per token x (2h input + gate/up {gate // f}f + 2f down input + 2h output "
            f"+ 36 B routing)"
        ] = m.top_k * (4 * h + gate + 2 * f + 36)
        if m.shared_ffn:
            out["shared experts: gated MLP (8 x f_shared)"] = 8 * m.shared_ffn
    elif m.gated:
        out["gated MLP: gate, act(gate), up, product (4 x 2f)"] = 8 * f
    else:
        out["MLP: activation input and output (2 x 2f)"] = 4 * f
    return out


def selective_bytes_per_token_layer(m: ModelShape) -> dict[str, int]:
    """Bytes per token per layer that selective activation checkpointing keeps (bf16), as the FSDP2
    recipe's policy does (``_sac_policy`` in ``recipes/qwen-fsdp2-sft/train.py``: the outputs of
    ``mm`` / ``addmm`` / ``bmm`` and of the attention kernels are saved, everything else is
    recomputed in the backward): the layer's input (the checkpoint's argument) and the output of
    every projection and of the attention. The norms, rotary embedding, activation function and
    residual sums are recomputed, so they cost nothing here; while one layer is recomputed its
    other tensors exist too (`estimate` adds one layer of `activation_bytes_per_token_layer`).

    Returns:
        item -> bytes per token per layer; their sum is the layer's total.
    """
    h, q, kv, f = m.hidden, m.q_dim, m.kv_dim, m.ffn
    return {
        "layer input (2h)": 2 * h,
        "q, k, v projections (2q + 2kv + 2kv)": 2 * q + 4 * kv,
        "attention output (2q)": 2 * q,
        "output projection (2h)": 2 * h,
        **(
            {"MoE router logits (2 x experts; the experts' grouped_mm is recomputed)": 2 * m.experts}
            if m.experts
            else {
                "MLP: " + ("gate and up projections (2f + 2f)" if m.gated else "up projection (2f)"): 4 * f
                if m.gated
                else 2 * f,
                "MLP down projection (2h)": 2 * h,
            }
        ),
    }


def logits_bytes(m: ModelShape, tokens: int, loss: str = "full", chunk: int = 4096) -> tuple[float, str]:
    """Peak bytes of the vocabulary logits and the loss (added to the activations).

    ``full`` (``train.loss=full`` and ``transformers``' ``ForCausalLMLoss``: bf16 logits upcast to
    fp32, then cross-entropy): at the start of the backward three fp32 tensors of tokens x vocab
    are alive: the log-softmax output saved by the forward, the gradient the NLL loss hands back,
    and the gradient log-softmax produces (12 bytes per logit; the forward's bf16 logits + fp32
    copy + log-softmax output, 10 bytes, is lower).
    ``chunked`` (``train.loss=chunked``, ``cookbook.sft.linear_cross_entropy_sum``): one chunk of
    min(chunk, tokens) labelled tokens at a time, 8 bytes per logit (the fp32 logits, reused in place
    for the softmax and its gradient, and the log-sum-exp's fp32 temporary), plus what the loss's
    forward computes and keeps until its backward: the head's gradient (2 B x vocab x h, bf16) and the
    hidden states of the labelled positions with their gradient (2 x 2 B x tokens x h; all tokens
    counted as labelled).
    ``fused`` (TRL's fused LM head, Liger's fused linear cross-entropy): the logits exist one tile at
    a time, taken as 0. Models without a head over the vocabulary (classifiers) have none.
    """
    if not m.lm_head or loss == "fused":
        return 0.0, "0 (no vocabulary head)" if not m.lm_head else "0 (fused loss: logits one tile at a time)"
    if loss == "chunked":
        c = min(chunk, tokens)
        return (
            8.0 * c * m.vocab + 2.0 * m.vocab * m.hidden + 4.0 * tokens * m.hidden,
            f"8 B x {c:,} tokens x {m.vocab:,} vocab (one chunk) + 2 B x {m.vocab:,} x {m.hidden} (head gradient) "
            f"+ 4 B x {tokens:,} x {m.hidden} (labelled hidden states and their gradient)",
        )
    return (
        12.0 * tokens * m.vocab,
        f"12 B x {tokens:,} tokens x {m.vocab:,} vocab (3 fp32 copies at the start of backward)",
    )


def lora_working_bytes(t: Technique, m: ModelShape, lora: LoraSpec, gpus: int) -> tuple[float, str]:
    """Transient buffers of a LoRA row that do not scale with the batch.

    FSDP2 as accelerate prepares it for the Trainer (``fsdp2_prepare_model``, accelerate 1.15): the
    tail unit (final norm and output head; the embedding too when tied) is not resharded after
    forward, so it stays gathered in bf16 until the backward (2 x head); decoder layers are gathered
    in bf16, the running one and the prefetched one (2 x 2 x layer), and one layer's adapter
    gradients (6 B x adapter params of a layer, bf16 and fp32). With one GPU FSDP2 does no
    all-gather (``world_size == 1`` in ``_fsdp_param_group.py``, torch 2.11 to 2.13): it copies a
    layer's shards into its unsharded tensors when the layer runs, so one layer is counted. The
    frozen base has no gradients to reduce-scatter. DDP: 0 (its buckets are in `lora_state_bytes`).
    """
    if not t.fsdp:
        return 0.0, "0"
    tail = m.head_params or m.embed_params
    gathered = 1 if gpus == 1 else 2
    return (
        2.0 * tail + gathered * 2 * m.layer_params + 6 * lora.layer_params(m),
        f"2 B x {tail:,} (output head, kept gathered) + {gathered} x 2 B x {m.layer_params:,} "
        f"(gathered layer{'s' if gathered > 1 else ''}) + 6 B x {lora.layer_params(m):,} (a layer's adapter grads)",
    )


def working_bytes(t: Technique, m: ModelShape) -> tuple[float, str]:
    """Transient buffers during forward and backward that do not scale with the batch.

    FSDP2: the root module (embedding, final norm, head) stays unsharded in bf16 from forward to
    backward (FSDP2 does not reshard the root after forward), 2 layers in bf16 (the running one
    and the prefetched one) and one layer's unsharded gradient in bf16 and in fp32 (cast for
    the fp32 reduce-scatter): 2·(embed + head) + 2·2·layer + 6·layer.
    ZeRO-3: the larger of embedding / head and 2 layers gathered in bf16, one layer's bf16
    gradient, one bf16 reduce bucket (DeepSpeed's default 5e8 elements).
    ZeRO-1/2: one bf16 reduce bucket. DDP: its buckets are in `bytes_per_param`.
    """
    layer, root = m.layer_params, m.embed_params + m.head_params
    if t.fsdp:
        return 2 * root + 4 * layer + 6 * layer, "2 x root (embedding + head) + 10 B x layer params (gathered, grads)"
    if t.zero == 3:
        return (
            2 * max(m.embed_params, m.head_params) + 6 * layer + 2 * DS_REDUCE_BUCKET,
            "2 x max(embedding, head) + 6 B x layer params + 1 GB reduce bucket",
        )
    if t.zero:
        return 2 * DS_REDUCE_BUCKET, "1 GB reduce bucket (5e8 bf16)"
    return 0.0, "0"


def step_bytes(t: Technique, m: ModelShape, gpus: int) -> tuple[float, str]:
    """Transient bytes of the optimizer step (activations are gone by then): DeepSpeed's fp32 copy
    of the gradients it steps on (``_prepare_fp32_grad_for_sub_group`` in stage 3, one sub-group of
    at most 1e9 elements at a time; the whole partition in stages 1/2). Fused AdamW in DDP and FSDP2
    allocates no tensor of that size."""
    if t.zero == 3:
        n = min(math.ceil(m.params / gpus), DS_SUB_GROUP)
        return 4.0 * n, f"4 B x {n:,} (fp32 grads of one optimizer sub-group)"
    if t.zero:
        return 4.0 * m.params / gpus, "4 B x params / N (fp32 copy of the gradient partition)"
    return 0.0, "0"


@dataclass
class Estimate:
    """Peak allocated bytes per GPU of one technique, and its parts (bytes); ``loss``: the loss the
    logits were counted with (`Technique.loss_for`)."""

    technique: Technique
    states: float
    activations: float
    logits: float
    working: float
    step: float
    host: float = 0.0
    loss: str = "full"
    notes: dict[str, str] = field(default_factory=dict)

    @property
    def backward_peak(self) -> float:
        return self.states + self.activations + self.logits + self.working

    @property
    def peak(self) -> float:
        """max(start of backward, optimizer step), bytes."""
        return max(self.backward_peak, self.states + self.step + (self.working if self.technique.zero else 0.0))


def estimate(
    t: Technique,
    m: ModelShape,
    gpus: int,
    seq: int,
    micro_batch: int,
    compiled: bool = False,
    loss: str = "full",
    chunk: int = 4096,
    lora: LoraSpec | None = None,
) -> Estimate:
    """Peak GPU memory per GPU (bytes) of technique `t` for `micro_batch` sequences of `seq` tokens
    per GPU: model states (`bytes_per_param`), activations (`activation_bytes_per_token_layer` x
    tokens x layers; with AC, each layer's bf16 input, 2h bytes per token, plus one layer's full
    activations while it is recomputed; with selective AC, `selective_bytes_per_token_layer` x
    layers plus that one recomputed layer), one final norm (8h per token), logits (`logits_bytes` of
    ``t.loss_for(loss)``: a loss the row's recipe does not have is counted as ``full``; `chunk`
    tokens per chunk of the chunked loss) and working buffers (`working_bytes`); or the optimizer
    step (`step_bytes`) if larger.

    A LoRA row (``t.lora``, with `lora`): `lora_state_bytes`, `lora_activation_bytes_per_token_layer`
    (bf16 adapters under FSDP2) in the same AC arithmetic, a final norm of 4h per token (its fp32
    input; the weight is frozen), `lora_working_bytes`, no optimizer-step transient (the adapters'
    fused AdamW allocates nothing of note).

    Raises:
        ChooserError: non-positive GPUs, sequence or micro-batch; a LoRA row without `lora`;
            ``compiled`` with a LoRA row (not modelled).
    """
    if gpus < 1:
        raise ChooserError(f"--gpus must be a positive number of GPUs, got {gpus}")
    if seq < 1 or micro_batch < 1:
        raise ChooserError(f"--seq and --micro-batch must be positive, got {seq} and {micro_batch}")
    if t.lora:
        if lora is None:
            raise ChooserError(f"{t.name}: a LoRA row needs the adapters (LoraSpec)")
        if compiled:
            raise ChooserError("--compile with --lora is not modelled")
    tokens = seq * micro_batch
    if t.lora:
        bpp_total, bpp_note = lora_state_bytes(t, m, lora, gpus)
        per_layer = sum(lora_activation_bytes_per_token_layer(m, lora, bf16_adapters=t.fsdp).values())
        norm, work_pair = 4, lora_working_bytes(t, m, lora, gpus)
    else:
        bpp, bpp_note = bytes_per_param(t, gpus)
        bpp_total, bpp_note = bpp * m.params, f"{bpp:.2f} B/param = {bpp_note}"
        per_layer = sum(activation_bytes_per_token_layer(m, compiled).values())
        norm, work_pair = 8, working_bytes(t, m)
    if t.ac:
        acts = tokens * (2 * m.hidden * m.layers + per_layer)
        act_note = (
            f"{tokens:,} tokens x (2h x {m.layers} layer inputs + {per_layer:,} B for the layer being recomputed)"
        )
    elif t.sac:
        kept = sum(selective_bytes_per_token_layer(m).values())
        acts = tokens * (kept * m.layers + per_layer)
        act_note = f"{tokens:,} tokens x ({kept:,} B kept x {m.layers} layers + {per_layer:,} B for the layer being recomputed)"
    else:
        acts = tokens * per_layer * m.layers
        act_note = f"{tokens:,} tokens x {per_layer:,} B x {m.layers} layers"
    acts += tokens * norm * m.hidden
    used = t.loss_for(loss)
    logits, logits_note = logits_bytes(m, tokens, used, chunk)
    work, work_note = work_pair
    step, step_note = (0.0, "0") if t.lora else step_bytes(t, m, gpus)
    return Estimate(
        t,
        bpp_total,
        acts,
        logits,
        work,
        step,
        host=16 * m.params / gpus if t.offload else 0.0,
        loss=used,
        notes={
            "states": bpp_note,
            "activations": act_note + f" + final norm {norm}h/token",
            "logits": logits_note,
            "working": work_note,
            "step": step_note,
        },
    )


def recommend(
    estimates: dict[str, Estimate], gpu_mem_gib: float, headroom: float = 0.10
) -> tuple[str | None, str | None]:
    """The first technique in `NATIVE_ORDER` and in `ZERO_ORDER` (LoRA rows: `LORA_ORDER`, and
    ``None`` for ZeRO) whose peak is at most (1 - headroom) x gpu_mem_gib; ``None`` where none fits."""
    budget = (1 - headroom) * gpu_mem_gib * GIB
    pick = lambda order: next((n for n in order if n in estimates and estimates[n].peak <= budget), None)
    if all(e.technique.lora for e in estimates.values()):
        return pick(LORA_ORDER), None
    return pick(NATIVE_ORDER), pick(ZERO_ORDER)


# ----------------------------------------------------------------------------- the command
def report(
    m: ModelShape,
    gpus: int,
    gpu_mem_gib: float,
    seq: int,
    micro_batch: int,
    compiled: bool,
    loss: str,
    headroom: float,
    chunk: int = 4096,
    lora: LoraSpec | None = None,
) -> str:
    """The printed arithmetic, the table and the recommendation (the LoRA rows with `lora`)."""
    g = lambda b: f"{b / GIB:.1f}"
    techniques = LORA_TECHNIQUES if lora else TECHNIQUES
    est = {t.name: estimate(t, m, gpus, seq, micro_batch, compiled, loss, chunk, lora) for t in techniques}
    moe = (
        (
            f" MoE: {m.experts} experts, {m.top_k} per token, f={m.ffn} each"
            f"{f', shared f={m.shared_ffn}' if m.shared_ffn else ''}{', attention sinks' if m.sinks else ''}"
        )
        if m.experts
        else ""
    )
    lines = [
        f"model: {m.name}  ({m.counted_by})",
        (
            f"  parameters {m.params:,} = embedding {m.embed_params:,} + untied head {m.head_params:,} + "
            f"{m.layers} layers x ~{m.layer_params:,} + rest"
        ),
        (
            f"  h={m.hidden} q={m.q_dim} kv={m.kv_dim} f={m.ffn} ({'gated' if m.gated else 'plain'} MLP"
            f"{', q/k norms' if m.qk_norm else ''}) vocab={m.vocab:,}{'' if m.lm_head else ' (no vocabulary head)'}{moe}"
        ),
    ]
    if lora:
        lines.append(
            f"  LoRA r={lora.r} on {', '.join(lora.targets)}: {lora.params(m):,} adapter parameters "
            f"({m.layers} layers x {lora.layer_params(m):,} = sum of r x (in + out)); the base frozen in bf16"
        )
    lines += [
        (
            f"run: {gpus} GPU(s) x {gpu_mem_gib:g} GiB, seq {seq} x micro-batch {micro_batch} = {seq * micro_batch:,} "
            f"tokens per GPU, {'per-layer torch.compile' if compiled else 'eager'}, {loss} loss"
            f"{'' if loss == 'full' else ' where the recipe has it (' + ', '.join(sorted({t.recipe_for(m) for t in techniques if loss in t.losses})) + ')'}"
        ),
        "",
    ]
    tables = (
        [
            ("LoRA, adapters fp32 (DDP rows)", lora_activation_bytes_per_token_layer(m, lora)),
            ("LoRA, adapters gathered in bf16 (FSDP2 rows)", lora_activation_bytes_per_token_layer(m, lora, True)),
        ]
        if lora
        else [
            (
                f"{'compiled' if compiled else 'eager'}; Korthikanti et al. 2022 eq. (1) adapted",
                activation_bytes_per_token_layer(m, compiled),
            ),
            ("kept with selective AC", selective_bytes_per_token_layer(m)),
        ]
    )
    for title, items in tables:
        lines.append(f"activations per token per layer ({title}):")
        lines += [f"  {v:>9,} B  {k}" for k, v in items.items()]
        lines.append(f"  {sum(items.values()):>9,} B  total")
    lines += ["", "model states on each GPU:" if lora else "bytes per parameter on each GPU (model states):"]
    for t in techniques:
        lines.append(f"  {t.name:<26} {est[t.name].notes['states']}")
    if lora:
        for t in techniques:
            if t.fsdp and not t.ac:
                lines.append(f"  FSDP2 buffers: {est[t.name].notes['working']}")
    lines.append("")
    for used in dict.fromkeys(e.loss for e in est.values()):  # each loss counted, in table order
        rows = [n for n, e in est.items() if e.loss == used]
        why = "" if used == loss else f"; their recipes have no {loss} loss, so the full logits are counted"
        which = "all rows" if len(rows) == len(est) else ", ".join(rows)
        lines.append(f"logits, {used} loss ({which}{why}): {est[rows[0]].notes['logits']}")
    lines.append("")
    head = f"{'technique':<26} {'states':>7} {'activ.':>7} {'logits':>7} {'buffers':>7} {'step':>6} {'PEAK':>7}  GiB per GPU"
    lines += [head, "-" * len(head)]
    budget = (1 - headroom) * gpu_mem_gib
    for n, e in est.items():
        fits = "fits" if e.peak <= budget * GIB else "too big"
        host = f", host {g(e.host)} GiB per GPU" if e.host else ""
        lines.append(
            f"{n:<26} {g(e.states):>7} {g(e.activations):>7} {g(e.logits):>7} {g(e.working):>7} {g(e.step):>6} "
            f"{g(e.peak):>7}  {fits}{host}"
        )
    native, zero = recommend(est, gpu_mem_gib, headroom)
    native_order = LORA_ORDER if lora else NATIVE_ORDER

    def why(pick: str | None, order: list[str]) -> str:
        tried = order[: order.index(pick)] if pick else order
        over = ", ".join(f"{n} {g(est[n].peak)}" for n in tried)
        fit = (
            f" ({g(est[pick].peak)} GiB <= {budget:.1f}; {est[pick].technique.recipe_for(m)}, {est[pick].loss} loss)"
            if pick
            else ""
        )
        return f"{fit}{'; too big before it: ' + over if pick and over else '; all too big: ' + over if over else ''}"

    lines += [
        "",
        f"budget: {gpu_mem_gib:g} GiB x (1 - {headroom:g} headroom) = {budget:.1f} GiB per GPU",
        f"recommended: {native or 'none fits: more GPUs, a shorter sequence or a smaller micro-batch'}"
        f"{why(native, native_order)}",
    ]
    if lora:
        lines.append("on DeepSpeed: LoRA with ZeRO is not modelled")
    else:
        lines.append(f"on DeepSpeed: {zero or 'no ZeRO stage fits'}{why(zero, ZERO_ORDER)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="config.json, a folder holding one, or a Hugging Face hub id")
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs (data-parallel ranks)")
    p.add_argument("--gpu-mem-gib", type=float, required=True, help="memory per GPU, GiB")
    p.add_argument("--seq", type=int, required=True, help="sequence length, tokens")
    p.add_argument("--micro-batch", type=int, required=True, help="sequences per GPU per forward")
    p.add_argument("--compile", action="store_true", help="per-layer torch.compile (fewer saved activations)")
    p.add_argument(
        "--loss",
        choices=["full", "chunked", "fused"],
        default=None,
        help="full: fp32 logits for the whole micro-batch (default; with --lora: fused); chunked: the recipes' "
        "train.loss=chunked (--loss-chunk tokens at a time); fused: TRL / Liger fused loss (no logits kept; "
        "TRL's SFTTrainer uses its fused LM head)",
    )
    p.add_argument("--loss-chunk", type=int, default=4096, help="tokens per chunk of --loss chunked (default 4096)")
    p.add_argument("--headroom", type=float, default=0.10, help="fraction of GPU memory kept free (default 0.10)")
    p.add_argument("--no-meta", action="store_true", help="count parameters from config fields, not transformers")
    p.add_argument(
        "--lora",
        action="store_true",
        help="LoRA rows instead (recipes/gpt-oss-lora-trl): frozen bf16 base, fp32 adapters with AdamW; "
        "DDP and FSDP2, without and with full AC",
    )
    p.add_argument("--lora-r", type=int, default=16, help="LoRA rank (default 16)")
    p.add_argument(
        "--lora-targets",
        default="q_proj,k_proj,v_proj,o_proj",
        help=f"comma-separated target modules (default q_proj,k_proj,v_proj,o_proj, the recipe's); of {', '.join(LORA_DIMS)}",
    )
    a = p.parse_args(argv)
    try:
        if a.gpus < 1:
            raise ChooserError(f"--gpus must be a positive number of GPUs, got {a.gpus}")
        if a.gpu_mem_gib <= 0 or not 0 <= a.headroom < 1:
            raise ChooserError("--gpu-mem-gib must be positive and --headroom in [0, 1)")
        if a.loss_chunk < 1:
            raise ChooserError(f"--loss-chunk must be a positive number of tokens, got {a.loss_chunk}")
        m = model_shape(a.model, meta=not a.no_meta)
        lora = LoraSpec(a.lora_r, tuple(x.strip() for x in a.lora_targets.split(",") if x.strip())) if a.lora else None
        if lora:
            lora.layer_params(m)  # bad targets or rank: one sentence
        loss = a.loss or ("fused" if a.lora else "full")
        print(report(m, a.gpus, a.gpu_mem_gib, a.seq, a.micro_batch, a.compile, loss, a.headroom, a.loss_chunk, lora))
    except ChooserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
