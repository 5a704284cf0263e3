"""LoRA fine-tune of Llama-3.2-3B with Unsloth, one model copy per GPU (DDP), TRL's SFTTrainer underneath.

    pip install -r recipes/unsloth-lora-ddp/requirements.txt -e shared     # its own environment (see README)
    bash recipes/unsloth-lora-ddp/launch.sh                                 # every GPU of this node, DDP
    NGPU=1 bash recipes/unsloth-lora-ddp/launch.sh train.max_steps=50 lora.r=32
    CONFIG_FILE=tiny.yaml bash recipes/unsloth-lora-ddp/launch.sh          # tiny twin (model.loader=transformers on CPU)

``model.loader`` picks how the model and its adapters are built: ``unsloth`` (``FastLanguageModel``) or
``transformers`` (``AutoModelForCausalLM`` + PEFT, the plain TRL path); data, LoRA settings, trainer arguments and
metrics are the same code, so the two compare one to one. Each rank loads the whole model on its own GPU and the
Trainer wraps it in DistributedDataParallel. What it supports: README.md beside this file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from pathlib import Path

from cookbook import config as cfgmod
from cookbook import hub
from cookbook.config import ConfigError
from cookbook.entry import cli

if TYPE_CHECKING:  # imported where used, after the config is checked
    from cookbook import sft

LOADERS = ("unsloth", "transformers")
ATTENTION = ("auto", "varlen", "sdpa", "eager")  # model.attn_implementation of the transformers loader
COMPILE_BACKEND = "inductor"  # train.compile's (the CPU tests set aot_eager: inductor's C++ build is slow)
CANNOT_REMAP = "the Trainer's data order and per-rank RNG states depend on it"  # why a resume keeps the world size


@dataclass
class ModelConfig:
    name_or_path: str = "meta-llama/Llama-3.2-3B"  # a hub id or a folder (config.json, weights, tokenizer)
    pretrained: bool = True  # false: random init from the config (benchmarks)
    tokenizer: str | None = None  # default: name_or_path
    loader: str = "unsloth"  # unsloth | transformers (plain TRL + PEFT)
    load_in_4bit: bool = False  # QLoRA through bitsandbytes (Unsloth only)
    attn_implementation: str = "auto"  # transformers loader: auto (varlen on CUDA, sdpa on CPU), varlen, sdpa, eager


@dataclass
class DataConfig:
    train_files: list[str] = field(default_factory=lambda: ["alpaca_data_sample5000.json"])
    max_length: int = 2048
    packing: bool = False
    completion_only: bool = True  # loss on the answer (the last assistant turn) only
    reasoning: str = "train"  # an answer's reasoning_content / thinking: train (rendered by the
    # chat template, in the loss) or drop (removed, counted)


@dataclass
class TrainConfig:
    seed: int = 42
    micro_batch_size: int = 4
    grad_accum_steps: int = 1
    epochs: int = 1  # passes over the rows, each row once (cookbook.hf_trainer.Bookkeeping)
    max_steps: int = 200  # > 0: this many optimizer steps, whatever epochs says; -1: epochs
    lr: float = 2.0e-4
    warmup_steps: int = 10
    scheduler: str = "cosine"
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    mixed_precision: str = "bf16"  # bf16 | fp32
    gradient_checkpointing: bool = True  # Unsloth's own ("unsloth") with the unsloth loader
    compile: bool = False  # transformers loader: torch.compile each decoder layer (Unsloth compiles them itself)
    log_every: int = 5
    stop_at_step: int = -1  # > 0: checkpoint and stop after this step; run again to continue
    on_nonfinite: str = "stop"  # a step with NaN/inf gradients: stop (exit 4) or skip (leave it out)
    max_consecutive_skips: int = 5  # on_nonfinite=skip: the run stops at one more non-finite step in a row
    collective_timeout_s: float = 1800.0  # a collective waiting longer ends the run, naming the rank behind


@dataclass
class CheckpointConfig(cfgmod.CheckpointConfig):  # every_steps, keep_last, resume
    export_merged: bool = True  # also <output_dir>/final: the base with the adapter merged in


@dataclass
class Config:
    output_dir: str = "outputs/unsloth-llama3.2-3b-lora"
    run_name: str = "unsloth-llama3.2-3b-lora"
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: cfgmod.LoraConfig = field(
        default_factory=lambda: cfgmod.LoraConfig(target_modules=list(cfgmod.DECODER_LINEARS))
    )
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


# What may differ from the checkpoint a run resumes (train.stop_at_step, checkpoint.*, ...; "key=value": a key that a
# checkpoint from before it existed lacks, equal at its default).
MAY_CHANGE = (*cfgmod.MAY_CHANGE, "train.epochs=1", "data.reasoning=train", "train.compile")


def load(path: str | Path, overrides: list[str] = ()) -> Config:
    """The config of `path` with `overrides`, checked; relative paths resolve against the config's folder.

    Raises:
        ConfigError: an unknown key or a wrong type (naming the key and the file), or a value out of range
            (`cookbook.config.check_run` for the checkpoint keys and ``output_dir``; ``train.on_nonfinite``).
    """
    cfg = cfgmod.load_config(Config, path, overrides)
    where = f"{path}"
    if cfg.model.loader not in LOADERS:
        raise ConfigError(f"{where}: model.loader must be one of {', '.join(LOADERS)}, got {cfg.model.loader!r}")
    if cfg.train.mixed_precision not in ("bf16", "fp32"):
        raise ConfigError(f"{where}: train.mixed_precision must be bf16 or fp32, got {cfg.train.mixed_precision!r}")
    if cfg.model.attn_implementation not in ATTENTION:
        raise ConfigError(
            f"{where}: model.attn_implementation must be one of {', '.join(ATTENTION)}, "
            f"got {cfg.model.attn_implementation!r}"
        )
    if cfg.model.load_in_4bit and cfg.model.loader != "unsloth":
        raise ConfigError(f"{where}: model.load_in_4bit needs model.loader=unsloth")
    if cfg.train.compile and cfg.model.loader != "transformers":
        raise ConfigError(f"{where}: train.compile needs model.loader=transformers (Unsloth compiles its own)")
    for key in (
        "lora.r",
        "lora.alpha",
        "data.max_length",
        "train.micro_batch_size",
        "train.grad_accum_steps",
        "train.epochs",
        "train.log_every",
    ):
        if cfgmod.field_value(cfg, key) < 1:
            raise ConfigError(f"{where}: {key} must be at least 1, got {cfgmod.field_value(cfg, key)}")
    if cfg.data.reasoning not in ("train", "drop"):
        why = (
            ": TRL's prompt-completion rows put the whole answer in the loss, so reasoning in context without loss "
            "cannot be marked"
            if cfg.data.reasoning == "context"
            else ""
        )
        raise ConfigError(f"{where}: data.reasoning must be train or drop, got {cfg.data.reasoning!r}{why}")
    if cfg.train.max_steps < 1 and cfg.train.max_steps != -1:
        raise ConfigError(
            f"{where}: train.max_steps must be at least 1, or -1 (train.epochs passes), got {cfg.train.max_steps}"
        )
    if not 0.0 <= cfg.lora.dropout < 1.0:
        raise ConfigError(f"{where}: lora.dropout must be in [0, 1), got {cfg.lora.dropout}")
    if not cfg.lora.target_modules:
        raise ConfigError(f"{where}: lora.target_modules is empty")
    if cfg.model.load_in_4bit and cfg.checkpoint.export_merged:
        raise ConfigError(
            f"{where}: model.load_in_4bit cannot merge the adapter into 4-bit weights: set "
            f"checkpoint.export_merged=false (the adapter is still written to <output_dir>/adapter)"
        )
    from cookbook.loop import NonFinitePolicy

    try:
        cfgmod.check_run(cfg)  # checkpoint.every_steps / keep_last, train.stop_at_step, output_dir writable
        cfgmod.check_fields(  # this recipe's optimizer keys (train.*), which torch would refuse only in the workers
            cfg,
            at_least={"train.warmup_steps": 0, "train.weight_decay": 0, "train.max_grad_norm": 0},
            within={"train.lr": "(0, inf)"},
        )
        NonFinitePolicy.settings(cfg.train)  # train.on_nonfinite, train.max_consecutive_skips
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    base = Path(path).parent
    cfg.data.train_files = [hub.resolve_path(f, base) for f in cfg.data.train_files]
    cfg.model.name_or_path = hub.resolve_path(cfg.model.name_or_path, base)
    hub.check_local_model(cfg.model.name_or_path, "model.name_or_path")  # a path, not a hub id: said so, not tried
    if cfg.model.tokenizer:
        cfg.model.tokenizer = hub.resolve_path(cfg.model.tokenizer, base)
        hub.check_local_model(cfg.model.tokenizer, "model.tokenizer", tokenizer=True)
    cfg.config_file = where  # not a config key: what the messages name
    return cfg


def training_rows(cfg: Config, tokenizer=None) -> tuple[list[dict], list[tuple["sft.SFTStats", list[list[int]]]]]:
    """Every row of `data.train_files` as a conversational prompt-completion row, ``{"prompt": [turns before the
    last], "completion": [the last assistant turn]}`` (TRL's format: the loss is on the completion), plus
    ``"tools"`` (the row's tool definitions as JSON text) when it declares tools; and per file the counts of the
    conversion (`cookbook.sft.SFTStats`: rows, empty answers skipped, tool calls, keys not used; ``example_rows``
    the 1-based row of each returned row) with, per returned row, the turns whose reasoning ``data.reasoning=drop``
    removed (`trl_examples` counts those of the examples kept after the length cut).

    Reasoning (``reasoning_content`` / ``thinking`` / reasoning parts) is placed as `cookbook.sft.prepare` does:
    under the key `tokenizer`'s chat template reads, or removed with ``data.reasoning=drop`` (counted).

    Raises:
        cookbook.sft.SFTDataError: a file or row that cannot be read, naming the file and the row; a
            row with reasoning that the chat template has no place for (``data.reasoning=drop`` trains without it).
    """
    import json
    from collections import Counter

    from cookbook import sft

    rows, parts = [], []
    for path in cfg.data.train_files:
        raw, ignored = sft.load_rows(path, "data.train_files"), Counter()
        st = sft.SFTStats(
            source=path,
            max_length=cfg.data.max_length,
            rows=len(raw),
            reasoning=cfg.data.reasoning,
            lines=raw.lines,
            unrendered_why="the chat template does not render them",
        )
        dropped_turns = []
        for n, row in enumerate(raw, 1):
            dropped = []
            try:
                messages, tools = sft.template_conversation(
                    row, st.label(n), path, tokenizer, st, ignored, reasoning=cfg.data.reasoning, dropped=dropped
                )
            except sft.EmptyAnswerError:
                st.empty_answers.append(n)
                continue
            rows.append(
                {
                    "prompt": messages[:-1],
                    "completion": messages[-1:],
                    **({"tools": json.dumps(tools)} if tools else {}),
                }
            )
            st.example_rows.append(n)
            dropped_turns.append(dropped)
        st.ignored = dict(ignored)
        parts.append((st, dropped_turns))
    if not rows:
        raise sft.SFTDataError(f"{', '.join(cfg.data.train_files)}: no row with an answer to train on")
    return rows, parts


def trl_dataset(rows: list[dict]):
    """`rows` as the ``datasets.Dataset`` TRL's SFTTrainer reads: each message stored as JSON (``datasets.Json``),
    so that a message keeps exactly its own keys (Arrow's inferred struct would add every other row's keys as
    nulls: tool-call arguments ``{"city": "Paris", "query": null}``); ``tools`` JSON text or None."""
    from datasets import Dataset, Features, Json, List, Value

    features = {"prompt": List(Json()), "completion": List(Json())}
    if any("tools" in r for r in rows):
        features["tools"] = Value("string")
        rows = [{"tools": None, **r} for r in rows]
    return Dataset.from_list(rows, features=Features(features))


def attention(cfg: Config, on_gpu: bool) -> str:
    """The transformers loader's ``attn_implementation``: ``auto`` is ``varlen`` on CUDA (packed rows through
    PyTorch's variable-length FlashAttention, document boundaries from TRL's padding-free ``cu_seq_lens_q``;
    unpacked rows are right-padded, which causal attention never reads), else ``sdpa``.

    Raises:
        ConfigError: ``varlen`` asked for on CPU (the kernel is CUDA only).
    """
    attn = cfg.model.attn_implementation
    if attn == "auto":
        return "varlen" if on_gpu else "sdpa"
    if attn == "varlen" and not on_gpu:
        raise ConfigError("model.attn_implementation=varlen runs on CUDA GPUs only: use sdpa (or auto) on CPU")
    return attn


def trl_examples(
    rows: list[dict], parts: list[tuple["sft.SFTStats", list[list[int]]]], tokenizer, cfg: Config
) -> list[tuple[list[dict], "sft.SFTStats"]]:
    """`training_rows`' rows tokenized as TRL's SFTTrainer does (the prompt rendered with the generation prompt,
    the whole conversation after it; the completion starts where the two first differ; ``data.completion_only``:
    labels on the completion's tokens only), cut at ``data.max_length``, with per file `parts`' counts completed
    (`cookbook.sft.SFTStats`: an example with no label left is dropped, as TRL drops it; reasoning the template
    rendered in the answer, left out, or dropped). For ``--show-examples`` and the data summary.

    Raises:
        cookbook.sft.SFTDataError: the chat template leaves out a row's tools, tool calls or tool results.
    """
    import json

    from cookbook import sft

    out, k = [], 0
    for st, dropped_turns in parts:
        examples, numbers = [], st.example_rows
        st.example_rows = []
        for n, dropped in zip(numbers, dropped_turns):
            row, k = rows[k], k + 1
            messages, tools = row["prompt"] + row["completion"], json.loads(row["tools"]) if row.get("tools") else None
            prompt = list(
                tokenizer.apply_chat_template(
                    row["prompt"], tools=tools, tokenize=True, add_generation_prompt=True, return_dict=False
                )
            )
            ids = list(tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False))
            start = next((i for i, (a, b) in enumerate(zip(prompt, ids)) if a != b), min(len(prompt), len(ids)))
            try:
                sft.check_tools_rendered(tokenizer, messages, tools, tokenizer.decode(ids))
            except sft.SFTDataError as exc:
                raise sft.SFTDataError(f"{st.source} {st.label(n)}: {exc}") from None
            reasoning, unrendered = [], []  # where the turns start: counted if training keeps them
            for i, m in enumerate(messages):  # reasoning: rendered in the answer (trained) or left out
                thought = (m.get("reasoning_content") or m.get("thinking") or "").strip()
                if thought and i == len(messages) - 1 and thought in tokenizer.decode(ids[start:]):
                    reasoning.append(start)
                elif thought and thought not in tokenizer.decode(ids):
                    unrendered.append(start if i == len(messages) - 1 else 0)
            labels = ([sft.IGNORE_INDEX] * start + ids[start:]) if cfg.data.completion_only else list(ids)
            calls = sum(len(m.get("tool_calls") or ()) for m in messages)
            dropped = [start if i == len(messages) - 1 else 0 for i in dropped]
            example = st.add(n, ids, labels, [(0, calls)], reasoning, unrendered, dropped)
            if example is not None:
                examples.append(example)
        out.append((examples, st))
    return out


def build_model(cfg: Config, info, dtype):
    """The model with LoRA adapters and its tokenizer, on this rank's device (the whole model per rank: DDP)."""
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = cfg.model.name_or_path
    tokenizer_path = cfg.model.tokenizer or path
    if not cfg.model.pretrained:  # random weights from the config, saved once so every loader reads a checkpoint
        path = str(Path(cfg.output_dir) / "random-init")
        if info.rank == 0 and not (Path(path) / "config.json").is_file():
            torch.manual_seed(cfg.train.seed)
            with torch.device(info.device):  # drawn on the GPU: the CPU's random generator runs on one thread
                model = AutoModelForCausalLM.from_config(
                    AutoConfig.from_pretrained(cfg.model.name_or_path), dtype=dtype
                )
            model.save_pretrained(path)
            AutoTokenizer.from_pretrained(tokenizer_path).save_pretrained(path)
            del model
            if info.device.type == "cuda":
                torch.cuda.empty_cache()
        if dist.is_initialized():
            dist.barrier()
        tokenizer_path = path
    device_map = {"": str(info.device)}  # this rank's whole copy: cuda:LOCAL_RANK (or cpu)
    if cfg.model.loader == "unsloth":
        from unsloth import FastLanguageModel

        model, tokenizer = FastLanguageModel.from_pretrained(
            model_name=path,
            tokenizer_name=tokenizer_path,
            max_seq_length=cfg.data.max_length,
            dtype=dtype,
            load_in_4bit=cfg.model.load_in_4bit,
            device_map=device_map,
            local_files_only=Path(path).is_dir(),
        )
        model = FastLanguageModel.get_peft_model(
            model,
            **cfg.lora.peft_kwargs(),
            bias="none",
            use_gradient_checkpointing="unsloth" if cfg.train.gradient_checkpointing else False,
            random_state=cfg.train.seed,
            max_seq_length=cfg.data.max_length,
        )
    else:
        from peft import LoraConfig as PeftLora, get_peft_model

        from cookbook import sft

        sft.register_varlen()  # attn_implementation: varlen (cookbook.sft.attention)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, device_map=device_map, attn_implementation=attention(cfg, info.device.type == "cuda")
        )
        model = get_peft_model(model, PeftLora(**cfg.lora.peft_kwargs(), bias="none", task_type="CAUSAL_LM"))
        if cfg.train.compile:  # each decoder layer one compiled region: its norms, rotary, LoRA and MLP fused
            for layer in model.base_model.model.model.layers:
                layer.compile(backend=COMPILE_BACKEND)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def import_unsloth(cfg: Config) -> None:
    """Import Unsloth first (it patches transformers, PEFT and TRL when imported) with ``model.loader=unsloth``.

    Raises:
        ConfigError: it does not import (``--check`` says so before any worker starts).
    """
    if cfg.model.loader == "unsloth":
        try:
            import unsloth  # noqa: F401
        except ImportError as exc:
            raise ConfigError(
                f"{cfg.config_file}: model.loader=unsloth, but Unsloth does not import ({exc}): install "
                f"the recipe's own environment (pip install -r recipes/unsloth-lora-ddp/requirements.txt "
                f"-e shared, on a CUDA GPU), or set model.loader=transformers"
            ) from None


def preflight(cfg: Config, world_size: int) -> str:
    """What ``--check`` runs in one process before any worker starts (launch.sh): Unsloth's import, every row as
    TRL sees it, the attention and positions, then the resume; returns the rows and the settings."""
    import_unsloth(cfg)
    from transformers import AutoTokenizer

    from cookbook import hf_trainer, sft

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer or cfg.model.name_or_path)
    rows, parts = training_rows(cfg, tokenizer)  # before the resume: a bad row is named on a used output_dir too
    stats = sft.SFTStats.merge([st for _, st in trl_examples(rows, parts, tokenizer, cfg)])
    sft.check_one_step(stats.examples, cfg.train.micro_batch_size, cfg.train.grad_accum_steps, world_size)
    if cfg.model.loader == "transformers":
        import torch

        try:
            attention(cfg, torch.cuda.is_available())
        except ConfigError as exc:
            raise ConfigError(f"{cfg.config_file}: {exc}") from None
    if (Path(cfg.model.name_or_path) / "config.json").is_file():  # a hub id: checked when the workers load it
        from transformers import AutoConfig

        sft.check_positions(
            cfg.data.max_length, AutoConfig.from_pretrained(cfg.model.name_or_path), cfg.model.name_or_path
        )
    hf_trainer.check_resume(cfg, world_size, MAY_CHANGE, CANNOT_REMAP)
    print(f"data: {stats.summary()}")
    return (
        f"{len(rows)} rows of {', '.join(cfg.data.train_files)}: ok (loader {cfg.model.loader}, LoRA r={cfg.lora.r} "
        f"alpha={cfg.lora.alpha}, seq {cfg.data.max_length})"
    )


def show_examples(cfg: Config, n: int) -> str:
    """What TRL's SFTTrainer trains on (one process, no worker, no Unsloth import)."""
    from transformers import AutoTokenizer

    from cookbook import sft

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer or cfg.model.name_or_path)
    return sft.show_examples(trl_examples(*training_rows(cfg, tokenizer), tokenizer, cfg), tokenizer, n)


@cli(load, preflight, show_examples, ok="config {path} and {detail}")  # --check: preflight; --show-examples N
def main(cfg: Config) -> None:
    import_unsloth(cfg)
    train(cfg)


def train(cfg: Config) -> None:
    """Build the model with LoRA and TRL's SFTTrainer (DDP), train, export the adapter. Run on every rank."""
    import torch
    from trl import SFTConfig, SFTTrainer

    import cookbook
    from cookbook import hf_trainer, sft
    from cookbook.loop import log_outputs
    from cookbook.metrics import MetricsLogger, ModelFlops, count_parameters

    out_dir, t = Path(cfg.output_dir), cfg.train
    info = cookbook.init_distributed(t.collective_timeout_s, debug_dir=out_dir / "debug")  # the Trainer's DDP group
    log = cookbook.get_logger()
    resume_from = hf_trainer.check_resume(cfg, info.world_size, MAY_CHANGE, CANNOT_REMAP)
    final = "final" if cfg.checkpoint.export_merged else "adapter"
    # train.max_steps=-1: the step count needs TRL's rows, checked once the trainer has them
    if t.max_steps > 0 and hf_trainer.finished(out_dir, resume_from, t.max_steps, final):
        return

    on_gpu = info.device.type == "cuda"
    dtype = torch.bfloat16 if t.mixed_precision == "bf16" and on_gpu else torch.float32
    model, tokenizer = build_model(cfg, info, dtype)
    rows, parts = training_rows(cfg, tokenizer)
    log.info(f"data: {sft.SFTStats.merge([st for _, st in trl_examples(rows, parts, tokenizer, cfg)]).summary()}")
    mc = model.config
    flops = ModelFlops(
        count_parameters(model),
        mc.num_hidden_layers,
        mc.num_attention_heads * getattr(mc, "head_dim", mc.hidden_size // mc.num_attention_heads),
    )
    metrics = MetricsLogger(
        out_dir,
        info,
        flops=flops,
        run_name=cfg.run_name,
        mlflow=False,
        max_steps=max(t.max_steps, 0),
        params=cfgmod.to_dict(cfg),
        progress=False,
    )
    args = SFTConfig(
        **hf_trainer.trainer_args(cfg, max(t.max_steps, 1)),
        learning_rate=t.lr,
        lr_scheduler_type=t.scheduler,
        warmup_steps=t.warmup_steps,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        bf16=dtype == torch.bfloat16,
        use_cpu=not on_gpu,
        gradient_checkpointing=t.gradient_checkpointing and cfg.model.loader == "transformers",
        max_length=cfg.data.max_length,
        packing=cfg.data.packing,
        completion_only_loss=cfg.data.completion_only,
        dataset_num_proc=None,
        ddp_find_unused_parameters=False,
        dataloader_num_workers=1,
    )

    # What TrainLoop does when things fail (cookbook.hf_trainer): preemption, non-finite steps, stalls, failed saves.
    run = hf_trainer.TrainerRun(cfg, metrics, sft.pad_token_id(tokenizer), resume_from)

    class Trainer(hf_trainer.Bookkeeping, SFTTrainer):  # here, not at module level: Unsloth patches TRL first (main)
        """TRL's SFTTrainer with the cookbook's bookkeeping (`hf_trainer.Bookkeeping`)."""

    trainer = Trainer(
        model=model, args=args, train_dataset=trl_dataset(rows), processing_class=tokenizer, callbacks=run.callbacks
    )
    examples, per_step = len(trainer.train_dataset), t.micro_batch_size * t.grad_accum_steps * info.world_size
    sft.check_one_step(
        examples, t.micro_batch_size, t.grad_accum_steps, info.world_size, " (TRL's, after truncation and packing)"
    )
    max_steps = t.max_steps if t.max_steps > 0 else t.epochs * (examples // per_step)
    args.max_steps, args.save_steps, metrics.max_steps = max_steps, cfg.checkpoint.every_steps or max_steps, max_steps
    if t.max_steps <= 0 and hf_trainer.finished(out_dir, resume_from, max_steps, final):
        metrics.close()
        return
    log.info(
        f"world size {info.world_size} ({info.backend}) | DDP | loader {cfg.model.loader} | "
        f"{flops.num_params / 1e6:,.1f} M non-embedding params | LoRA r={cfg.lora.r} | {len(rows)} rows | "
        f"global batch {per_step} rows | {max_steps} steps | {'bf16' if dtype == torch.bfloat16 else 'fp32'}"
    )

    with run:  # closes metrics and the group whatever happens
        if not run.train(trainer, max_steps):
            return  # train.stop_at_step: a checkpoint is published there
        step = trainer.state.global_step
        export_dir = hf_trainer.export_final(trainer, tokenizer, out_dir, merge=cfg.checkpoint.export_merged)
        metrics.log_summary(
            {"step": step, "loader": cfg.model.loader, "export_dir": str(export_dir) if export_dir else None}
        )
        log_outputs(
            step,
            {},
            metrics,
            run.root,
            {
                "export_dir": (
                    export_dir,
                    "AutoModelForCausalLM.from_pretrained"
                    if cfg.checkpoint.export_merged
                    else "PeftModel.from_pretrained",
                )
            },
        )


if __name__ == "__main__":
    from cookbook import run_main
    from cookbook.checkpoint import CheckpointError
    from cookbook.sft import SFTDataError

    run_main(main, user_errors=(ConfigError, SFTDataError, CheckpointError))
