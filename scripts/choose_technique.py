"""Which data-parallel technique fits? Peak GPU memory per GPU of DDP, FSDP2 and DeepSpeed ZeRO for a
transformer, with the arithmetic shown, and the simplest technique that fits with some headroom.

    python scripts/choose_technique.py Qwen/Qwen3-8B --gpus 2 --gpu-mem-gib 141 --seq 2048 --micro-batch 4
    python scripts/choose_technique.py path/to/config.json --gpus 8 --gpu-mem-gib 80 --seq 4096 --micro-batch 1
    python scripts/choose_technique.py path/to/config.json --gpus 2 --gpu-mem-gib 141 --seq 2048 --micro-batch 4 \\
        --compile --loss chunked          # per-layer torch.compile; cookbook's chunked loss (recipes/qwen-fsdp2-sft)

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


# ----------------------------------------------------------------------------- the model
def load_config(model: str) -> dict:
    """The model's config as a dict: from a ``config.json`` path, a folder holding one, or a hub id
    (``transformers.AutoConfig``, which needs the hub or its cache). Raises `ChooserError`."""
    path = Path(model).expanduser()
    looks_local = path.suffix == ".json" or model.startswith((".", "/", "~")) or path.parent.is_dir() and path.parent != Path(".")
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
            raise ChooserError(f"{model}: not a local config file and not loadable from the hub "
                               f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
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


def shape_from_fields(cfg: dict, name: str = "config") -> ModelShape:
    """Parameter count of a Llama-style decoder (GQA attention, gated MLP, RMSNorm) from its
    config fields: embedding V·h; per layer h·q + 2·h·kv + q·h (attention) + 3·h·f (gated MLP)
    + 2·h (norms) + 2·head_dim (q/k norms, Qwen3) + q + 2·kv (biases, Qwen2 or
    ``attention_bias``); final norm h; an untied head V·h.

    Exact for Llama, Mistral, Qwen2/2.5/3 dense; other architectures need `shape_from_meta`.
    """
    h, layers, q, kv, f, head_dim = _dims(cfg)
    vocab = int(cfg["vocab_size"])
    qk_norm = cfg.get("model_type") in ("qwen3", "olmo2")
    bias = q + 2 * kv if (cfg.get("attention_bias") or cfg.get("model_type") in QKV_BIAS_TYPES) else 0
    if cfg.get("attention_bias"):
        bias += h  # o_proj bias too
    layer = h * q + 2 * h * kv + q * h + 3 * h * f + 2 * h + (2 * head_dim if qk_norm else 0) + bias
    embed = vocab * h
    head = 0 if cfg.get("tie_word_embeddings", False) else vocab * h
    return ModelShape(name, embed + head + layers * layer + h, embed, head, layer, layers, h, q, kv, f, True,
                      qk_norm, vocab, True, "config fields")


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
    gated = round(mlp / (h * f)) >= 3 if f else True
    vocab = int(cfg.get("vocab_size") or 0)
    lm_head = out is not None and out.weight.shape[0] == vocab
    return ModelShape(name, params, embed, head, layer, layers, h, q, kv, f, gated,
                      bool(names & {"q_norm", "k_norm"}), vocab, lm_head, f"meta device ({type(model).__name__})")


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
    ``--loss`` choices its recipe has (`logits_bytes`); any other is counted as ``full``."""

    name: str
    zero: int = 0
    fsdp: bool = False
    ac: bool = False
    sac: bool = False
    offload: bool = False
    losses: tuple[str, ...] = ("full",)

    @property
    def recipe(self) -> str:
        """The cookbook recipe whose set-up the row's arithmetic follows."""
        return "recipes/qwen-fsdp2-sft" if self.fsdp else "recipes/qwen-zero3-receipts" if self.zero else "recipes/modernbert-ddp"

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

    Returns:
        item -> bytes per token per layer; their sum is the layer's total.
    """
    h, q, kv, f = m.hidden, m.q_dim, m.kv_dim, m.ffn
    if compiled:
        out = {"2 norms: bf16 input + output (2h + 2h each)": 8 * h}
        if m.qk_norm:
            out["q/k projections before their norms (2q + 2kv)"] = 2 * q + 2 * kv
        out["attention: q, k, v, output (2q + 2kv + 2kv + 2q)"] = 4 * q + 4 * kv
        out["MLP: " + ("gate and up projections (2f + 2f)" if m.gated else "activation input (2f)")] = 4 * f if m.gated else 2 * f
        return out
    out = {"2 norms, fp32 upcast: 4h fp32 input + 2h normalised + 2h output, each": 16 * h}
    if m.qk_norm:
        out["q/k norms (6q + 6kv)"] = 6 * q + 6 * kv
    out["attention: q, k, v, output (2q + 2kv + 2kv + 2q)"] = 4 * q + 4 * kv
    if m.gated:
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
    return {"layer input (2h)": 2 * h,
            "q, k, v projections (2q + 2kv + 2kv)": 2 * q + 4 * kv,
            "attention output (2q)": 2 * q,
            "output projection (2h)": 2 * h,
            "MLP: " + ("gate and up projections (2f + 2f)" if m.gated else "up projection (2f)"): 4 * f if m.gated else 2 * f,
            "MLP down projection (2h)": 2 * h}


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
        return (8.0 * c * m.vocab + 2.0 * m.vocab * m.hidden + 4.0 * tokens * m.hidden,
                f"8 B x {c:,} tokens x {m.vocab:,} vocab (one chunk) + 2 B x {m.vocab:,} x {m.hidden} (head gradient) "
                f"+ 4 B x {tokens:,} x {m.hidden} (labelled hidden states and their gradient)")
    return 12.0 * tokens * m.vocab, f"12 B x {tokens:,} tokens x {m.vocab:,} vocab (3 fp32 copies at the start of backward)"


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
        return (2 * max(m.embed_params, m.head_params) + 6 * layer + 2 * DS_REDUCE_BUCKET,
                "2 x max(embedding, head) + 6 B x layer params + 1 GB reduce bucket")
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


def estimate(t: Technique, m: ModelShape, gpus: int, seq: int, micro_batch: int, compiled: bool = False,
             loss: str = "full", chunk: int = 4096) -> Estimate:
    """Peak GPU memory per GPU (bytes) of technique `t` for `micro_batch` sequences of `seq` tokens
    per GPU: model states (`bytes_per_param`), activations (`activation_bytes_per_token_layer` x
    tokens x layers; with AC, each layer's bf16 input, 2h bytes per token, plus one layer's full
    activations while it is recomputed; with selective AC, `selective_bytes_per_token_layer` x
    layers plus that one recomputed layer), one final norm (8h per token), logits (`logits_bytes` of
    ``t.loss_for(loss)``: a loss the row's recipe does not have is counted as ``full``; `chunk`
    tokens per chunk of the chunked loss) and working buffers (`working_bytes`); or the optimizer
    step (`step_bytes`) if larger."""
    if gpus < 1:
        raise ChooserError(f"--gpus must be a positive number of GPUs, got {gpus}")
    if seq < 1 or micro_batch < 1:
        raise ChooserError(f"--seq and --micro-batch must be positive, got {seq} and {micro_batch}")
    tokens = seq * micro_batch
    bpp, bpp_note = bytes_per_param(t, gpus)
    per_layer = sum(activation_bytes_per_token_layer(m, compiled).values())
    if t.ac:
        acts = tokens * (2 * m.hidden * m.layers + per_layer)
        act_note = f"{tokens:,} tokens x (2h x {m.layers} layer inputs + {per_layer:,} B for the layer being recomputed)"
    elif t.sac:
        kept = sum(selective_bytes_per_token_layer(m).values())
        acts = tokens * (kept * m.layers + per_layer)
        act_note = f"{tokens:,} tokens x ({kept:,} B kept x {m.layers} layers + {per_layer:,} B for the layer being recomputed)"
    else:
        acts = tokens * per_layer * m.layers
        act_note = f"{tokens:,} tokens x {per_layer:,} B x {m.layers} layers"
    acts += tokens * 8 * m.hidden
    used = t.loss_for(loss)
    logits, logits_note = logits_bytes(m, tokens, used, chunk)
    work, work_note = working_bytes(t, m)
    step, step_note = step_bytes(t, m, gpus)
    return Estimate(t, bpp * m.params, acts, logits, work, step, host=16 * m.params / gpus if t.offload else 0.0, loss=used,
                    notes={"states": f"{bpp:.2f} B/param = {bpp_note}", "activations": act_note + " + final norm 8h/token",
                           "logits": logits_note, "working": work_note, "step": step_note})


def recommend(estimates: dict[str, Estimate], gpu_mem_gib: float, headroom: float = 0.10) -> tuple[str | None, str | None]:
    """The first technique in `NATIVE_ORDER` and in `ZERO_ORDER` whose peak is at most
    (1 - headroom) x gpu_mem_gib; ``None`` where none fits."""
    budget = (1 - headroom) * gpu_mem_gib * GIB
    pick = lambda order: next((n for n in order if estimates[n].peak <= budget), None)
    return pick(NATIVE_ORDER), pick(ZERO_ORDER)


# ----------------------------------------------------------------------------- the command
def report(m: ModelShape, gpus: int, gpu_mem_gib: float, seq: int, micro_batch: int, compiled: bool, loss: str,
           headroom: float, chunk: int = 4096) -> str:
    """The printed arithmetic, the table and the recommendation."""
    g = lambda b: f"{b / GIB:.1f}"
    est = {t.name: estimate(t, m, gpus, seq, micro_batch, compiled, loss, chunk) for t in TECHNIQUES}
    lines = [f"model: {m.name}  ({m.counted_by})",
             (f"  parameters {m.params:,} = embedding {m.embed_params:,} + untied head {m.head_params:,} + "
              f"{m.layers} layers x ~{m.layer_params:,} + rest"),
             (f"  h={m.hidden} q={m.q_dim} kv={m.kv_dim} f={m.ffn} ({'gated' if m.gated else 'plain'} MLP"
              f"{', q/k norms' if m.qk_norm else ''}) vocab={m.vocab:,}{'' if m.lm_head else ' (no vocabulary head)'}"),
             (f"run: {gpus} GPU(s) x {gpu_mem_gib:g} GiB, seq {seq} x micro-batch {micro_batch} = {seq * micro_batch:,} "
              f"tokens per GPU, {'per-layer torch.compile' if compiled else 'eager'}, {loss} loss"
              f"{'' if loss == 'full' else ' where the recipe has it (' + ', '.join(sorted({t.recipe for t in TECHNIQUES if loss in t.losses})) + ')'}"),
             "",
             f"activations per token per layer ({'compiled' if compiled else 'eager'}; Korthikanti et al. 2022 eq. (1) adapted):"]
    for k, v in activation_bytes_per_token_layer(m, compiled).items():
        lines.append(f"  {v:>9,} B  {k}")
    lines.append(f"  {sum(activation_bytes_per_token_layer(m, compiled).values()):>9,} B  total")
    lines.append("kept per token per layer with selective AC:")
    for k, v in selective_bytes_per_token_layer(m).items():
        lines.append(f"  {v:>9,} B  {k}")
    lines.append(f"  {sum(selective_bytes_per_token_layer(m).values()):>9,} B  total")
    lines += ["", "bytes per parameter on each GPU (model states):"]
    for t in TECHNIQUES:
        lines.append(f"  {t.name:<26} {est[t.name].notes['states']}")
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
        lines.append(f"{n:<26} {g(e.states):>7} {g(e.activations):>7} {g(e.logits):>7} {g(e.working):>7} {g(e.step):>6} "
                     f"{g(e.peak):>7}  {fits}{host}")
    native, zero = recommend(est, gpu_mem_gib, headroom)

    def why(pick: str | None, order: list[str]) -> str:
        tried = order[:order.index(pick)] if pick else order
        over = ", ".join(f"{n} {g(est[n].peak)}" for n in tried)
        fit = f" ({g(est[pick].peak)} GiB <= {budget:.1f}; {est[pick].technique.recipe}, {est[pick].loss} loss)" if pick else ""
        return f"{fit}{'; too big before it: ' + over if pick and over else '; all too big: ' + over if over else ''}"

    lines += ["", f"budget: {gpu_mem_gib:g} GiB x (1 - {headroom:g} headroom) = {budget:.1f} GiB per GPU",
              f"recommended: {native or 'none fits: more GPUs, a shorter sequence or a smaller micro-batch'}"
              f"{why(native, NATIVE_ORDER)}"]
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
    p.add_argument("--loss", choices=["full", "chunked", "fused"], default="full",
                   help="full: fp32 logits for the whole micro-batch (default); chunked: the recipes' train.loss=chunked "
                        "(--loss-chunk tokens at a time); fused: TRL / Liger fused loss (no logits kept)")
    p.add_argument("--loss-chunk", type=int, default=4096, help="tokens per chunk of --loss chunked (default 4096)")
    p.add_argument("--headroom", type=float, default=0.10, help="fraction of GPU memory kept free (default 0.10)")
    p.add_argument("--no-meta", action="store_true", help="count parameters from config fields, not transformers")
    a = p.parse_args(argv)
    try:
        if a.gpus < 1:
            raise ChooserError(f"--gpus must be a positive number of GPUs, got {a.gpus}")
        if a.gpu_mem_gib <= 0 or not 0 <= a.headroom < 1:
            raise ChooserError("--gpu-mem-gib must be positive and --headroom in [0, 1)")
        if a.loss_chunk < 1:
            raise ChooserError(f"--loss-chunk must be a positive number of tokens, got {a.loss_chunk}")
        m = model_shape(a.model, meta=not a.no_meta)
        print(report(m, a.gpus, a.gpu_mem_gib, a.seq, a.micro_batch, a.compile, a.loss, a.headroom, a.loss_chunk))
    except ChooserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
