"""Typed recipe configs: a YAML file plus dotted command-line overrides, checked against a dataclass (OmegaConf
structured configs). `load_config` merges the dataclass defaults, the YAML file and the overrides (``optim.lr=3e-5``);
an unknown key, a wrong type or a missing value is one `ConfigError` naming the key and its source."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import errno
import importlib.util
import operator
import os
import sys
import tempfile
import typing
from functools import reduce
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence, TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

from cookbook import push
from cookbook.errors import AlreadyComplete, ConfigError
from cookbook.requirements import check_trackers
from cookbook.requirements import require  # noqa: F401 (recipes call config.require)
from cookbook.run_lock import OUTPUT_DIR_FILE_ENV, complete_message, report_complete, report_output_dir

if typing.TYPE_CHECKING:
    import torch

T = TypeVar("T")


def _describe(exc: OmegaConfBaseException) -> str:
    key = getattr(exc, "full_key", None)
    msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    msg = msg.split(" (type ")[0] + " (true or false)" if "is not a valid bool" in msg else msg
    return f"key '{key}': {msg}" if key else msg


def _did_you_mean(cfg: Any, exc: OmegaConfBaseException) -> str:
    """``" (did you mean 'optim.lr'?)"`` for an unknown key close to a key of its section, else ``""``."""
    full = getattr(exc, "full_key", None)
    if not isinstance(exc, ConfigKeyError) or not full:
        return ""
    parent, _, name = str(full).rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    keys = [str(k) for k in node.keys()] if OmegaConf.is_dict(node) else []
    close = difflib.get_close_matches(name, keys, n=1, cutoff=0.6)
    return f" (did you mean '{parent + '.' if parent else ''}{close[0]}'?)" if close else ""


def _yaml_line(path: Path, dotted: str | None) -> int | None:
    """The 1-based line of key `dotted` (``train.eval_every``) in the YAML file `path`, or ``None``."""
    if not dotted:
        return None
    import yaml

    try:
        node = yaml.compose(path.read_text(encoding="utf-8"))
    except Exception:  # noqa: BLE001 - already loaded once; a line number is only a help
        return None
    line = None
    for part in str(dotted).split("."):
        if not isinstance(node, yaml.MappingNode):
            break
        found = next(((k, v) for k, v in node.value if getattr(k, "value", None) == part), None)
        if found is None:
            break
        line, node = found[0].start_mark.line + 1, found[1]
    return line


def config_not_found(p: Path, folder: Path | None = None) -> str:
    """The line for a missing config file `p`, naming the file of that name in `folder` (default: the script's)."""
    beside = None if p.is_absolute() else (folder or Path(sys.argv[0]).resolve().parent) / p
    hint = f"; {beside} exists: give that path" if beside is not None and beside.is_file() else ""
    return f"config file not found: {p} (from {Path.cwd()}){hint}"


def config_beside(script: str | Path, args: Sequence[str]) -> list[str]:
    """`args` with a relative ``--config`` (launch.sh's ``CONFIG_FILE``) taken from the current folder, else from
    `script`'s; a file of that name in both runs the current folder's and says so on stderr (a ``note:`` line)."""
    args = list(args)
    if "--config" not in args[:-1]:
        return args
    i = args.index("--config") + 1
    config, beside = Path(args[i]), Path(script).parent / args[i]
    if config.is_absolute() or not beside.is_file():
        return args
    if not config.is_file():
        args[i] = str(beside)
    elif not config.samefile(beside):
        print(
            f"note: --config {config} is this folder's ({config.resolve()}), not the one beside train.py "
            f"({beside}); its relative paths are read from {config.resolve().parent}",
            file=sys.stderr,
        )
    return args


def load_config(schema: type[T], path: str | Path | None = None, overrides: Sequence[str] = ()) -> T:
    """A `schema` instance: its defaults, then the YAML file at `path` (None: none), then the ``"section.key=value"``
    `overrides` (values parsed as YAML). Raises ConfigError naming the key and the file (with the line) or override:
    a missing or non-mapping file; an unknown key (with the closest one); a wrong type; a required value not given."""
    if not dataclasses.is_dataclass(schema):
        raise TypeError(f"schema must be a dataclass type, got {schema!r}")
    cfg = OmegaConf.structured(schema)
    sources: list[tuple[str, object]] = []
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(config_not_found(p))
        try:
            loaded = OmegaConf.load(p)
        except Exception as exc:  # YAML syntax errors come from several libraries
            raise ConfigError(f"{p}: not valid YAML: {exc}") from None
        if not OmegaConf.is_dict(loaded):
            raise ConfigError(f"{p}: the top level must be a mapping of sections")
        sources.append((str(p), loaded))
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r} is not of the form section.key=value")
        try:
            sources.append((f"override {item!r}", OmegaConf.from_dotlist([item])))
        except OmegaConfBaseException as exc:
            raise ConfigError(f"override {item!r}: {_describe(exc)}") from None
    for where, src in sources:
        _coerce(schema, src)
        try:
            cfg = OmegaConf.merge(cfg, src)
        except OmegaConfBaseException as exc:
            hint = " (a list is written [a,b])" if "ListConfig" in str(exc) else _did_you_mean(cfg, exc)
            line = _yaml_line(Path(path), getattr(exc, "full_key", None)) if where == str(path) else None
            raise ConfigError(f"{where}{f' line {line}' if line else ''}: {_describe(exc)}{hint}") from None
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"required config value(s) not set: {', '.join(missing)}")
    try:
        return to_object(cfg)
    except OmegaConfBaseException as exc:
        raise ConfigError(_describe(exc)) from None


def _coerce(schema: type, src: Any, values: Mapping[str, Any] | None = None, prefix: str = "") -> None:
    """In `src` (a DictConfig), in place, for the fields of `schema`: a float with no fraction (``30.0``) for an
    ``int`` becomes that integer, as the data readers take it; one string for a list of strings becomes a list of
    one (``data.train_files=a.jsonl``). ``1.5`` or a number for a list is left for the merge to refuse."""
    try:
        hints = typing.get_type_hints(schema)
    except Exception:  # noqa: BLE001 - an annotation this module cannot resolve: the merge checks the types alone
        return
    values = OmegaConf.to_container(src, resolve=False) if values is None else values
    for key, value in values.items():
        hint = hints.get(key)
        kinds = (hint, *typing.get_args(hint))
        if dataclasses.is_dataclass(hint) and isinstance(value, dict):
            _coerce(hint, src, value, f"{prefix}{key}.")
        elif int in kinds and isinstance(value, float) and value.is_integer():
            OmegaConf.update(src, f"{prefix}{key}", int(value))
        elif (
            isinstance(value, str)
            and any(typing.get_origin(k) is list for k in kinds)
            and "${" not in value
            and value != "???"
        ):
            OmegaConf.update(src, f"{prefix}{key}", [value], merge=False)


def to_object(cfg: Any) -> Any:
    """``OmegaConf.to_object(cfg)``, remembering the ``${oc.env:...}`` keys so that `to_dict` writes their text."""
    from_env = {
        k: v
        for k, v in flatten(OmegaConf.to_container(cfg, resolve=False)).items()
        if isinstance(v, str) and "${oc.env:" in v
    }
    obj = OmegaConf.to_object(cfg)
    if from_env:
        object.__setattr__(obj, _FROM_ENV, from_env)
    return obj


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested dict as one level with dotted keys: ``{"optim": {"lr": 1}}`` -> ``{"optim.lr": 1}``."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


_FROM_ENV = "_cookbook_from_env"  # attribute of a loaded config: dotted key -> its ``${oc.env:...}`` text


def to_dict(cfg: object) -> dict:
    """A config instance as a plain nested dict; values from the environment (``${oc.env:HF_TOKEN}``) as that text."""
    out = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    for key, text in getattr(cfg, _FROM_ENV, {}).items():
        *parents, leaf = key.split(".")
        reduce(operator.getitem, parents, out)[leaf] = text
    return out  # type: ignore[return-value]


def save_config(cfg: object, path: str | Path) -> None:
    """Write the config as YAML (`to_dict`: values from the environment as their ``${oc.env:...}`` text)."""
    Path(path).write_text(OmegaConf.to_yaml(OmegaConf.create(to_dict(cfg))))


def resolve_path(value: str, base_dir: str | Path) -> str:
    """A relative path of a config resolved against `base_dir` when it exists there; otherwise `value` (a hub id)."""
    candidate = Path(base_dir) / value
    return str(candidate) if value and not Path(value).is_absolute() and candidate.exists() else value


def field_value(cfg: object, key: str) -> Any:
    """The value of a dotted key of a config instance (``"train.micro_batch_size"``); ConfigError: no such key."""
    value = cfg
    for part in key.split("."):
        if not hasattr(value, part):
            raise ConfigError(f"{key}: no such config key")
        value = getattr(value, part)
    return value


def check_fields(
    cfg: object,
    *,
    at_least: Mapping[str, float] = {},
    one_of: Mapping[str, Iterable[Any]] = {},
    within: Mapping[str, str] = {},
    notes: Mapping[str, str] = {},
) -> None:
    """Check `at_least` ``{key: minimum}``, `one_of` ``{key: allowed}``, `within` ``{key: "[0, 1)"}``; `notes`
    ``{key: text}`` ends that key's message. ConfigError: ``train.micro_batch_size must be >= 1, got 0``."""

    def fail(key: str, rule: str, value: Any) -> None:
        note = f" ({notes[key]})" if key in notes else ""
        raise ConfigError(f"{key} must be {rule}, got {value!r}{note}")

    for key, minimum in at_least.items():
        value = field_value(cfg, key)
        if value < minimum:
            fail(key, f">= {minimum}", value)
    for key, allowed in one_of.items():
        allowed = list(allowed)
        value = field_value(cfg, key)
        if value not in allowed:
            fail(key, f"one of {', '.join(map(repr, allowed))}", value)
    for key, interval in within.items():
        low, high = (float(x) for x in interval[1:-1].split(","))
        value = field_value(cfg, key)
        above = value >= low if interval[0] == "[" else value > low
        below = value <= high if interval[-1] == "]" else value < high
        if not (above and below):
            fail(key, f"in {interval}", value)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        if message.startswith("unrecognized arguments: -"):  # `--max_steps 5`, as other trainers take it
            message += " (config overrides are written key=value without dashes, e.g. train.max_steps=5)"
        super().error(message)


def cli_parser(description: str | None = None, show_examples: bool = False) -> argparse.ArgumentParser:
    """``--config FILE``, ``--check``, overrides and, with `show_examples`, ``--show-examples N``."""
    parser = _Parser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML config file")
    parser.add_argument("--check", action="store_true", help="validate config and data, then exit")
    if show_examples:
        parser.add_argument(
            "--show-examples",
            type=int,
            default=0,
            metavar="N",
            help="print N rendered training rows per data file (labelled tokens between [[ and ]]) "
            "and the counts of what was kept, truncated and dropped, then exit (one process)",
        )
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=3e-5")
    return parser


# ----------------------------------------------------------------------------- sections every recipe shares
@dataclasses.dataclass
class OptimConfig:
    """``optim``: AdamW (Loshchilov & Hutter, 2019) and a ``get_scheduler`` schedule, made by `build_optimizer`."""

    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: list[float] = dataclasses.field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    scheduler: str = "cosine"  # a transformers SchedulerType: linear, cosine, constant_with_warmup, ...
    warmup_ratio: float = 0.03  # fraction of the optimizer steps
    max_grad_norm: float = 1.0  # clip the total gradient norm; 0: no clipping


def build_optimizer(
    optim: OptimConfig, params: Iterable[Any], max_steps: int, *, fused: bool, decay_1d: bool = True
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LRScheduler]:
    """AdamW over `params` (tensors, or param groups as torch.optim takes them) and transformers'
    ``get_scheduler(optim.scheduler)`` over `max_steps` optimizer steps, the first ``warmup_ratio * max_steps`` of them
    warm-up. ``decay_1d=False`` (tensors only): no weight decay on 1-D tensors (biases and norms)."""
    import torch
    from transformers import get_scheduler  # here: transformers imports torchvision, which a recipe checks first

    if not decay_1d:
        params = list(params)
        params = [
            {"params": [p for p in params if p.ndim >= 2]},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]
    optimizer = torch.optim.AdamW(
        params, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps, weight_decay=optim.weight_decay, fused=fused
    )
    warmup = int(optim.warmup_ratio * max_steps)
    scheduler = get_scheduler(optim.scheduler, optimizer, num_warmup_steps=warmup, num_training_steps=max_steps)
    return optimizer, scheduler


@dataclasses.dataclass
class TrainConfig:
    """``train``: the step loop; the global batch is micro_batch_size x grad_accum_steps x world size rows."""

    seed: int = 42
    micro_batch_size: int = 2  # rows per rank per micro-step
    grad_accum_steps: int = 1  # micro-batches per optimizer step
    epochs: int = 1
    max_steps: int = -1  # > 0: this many optimizer steps, whatever `epochs` says
    stop_at_step: int = -1  # > 0: checkpoint and stop after this step; run again to continue
    mixed_precision: str = "bf16"  # compute dtype on GPUs: bf16 or fp32 (CPU runs in fp32)
    activation_checkpointing: str = "none"  # none, full (recompute each layer in backward); selective where offered
    log_every: int = 10  # optimizer steps per log line
    eval_every: int = 0  # optimizer steps between evaluations; 0: at the end only
    profile_step: int = 0  # > 0: a torch.profiler trace of this step in <output_dir>/profile
    on_nonfinite: str = "stop"  # a step with a NaN/inf loss or gradient norm: stop (exit 4) or skip (drop it, go on)
    max_consecutive_skips: int = 5  # on_nonfinite=skip: the run stops at one more non-finite step in a row
    collective_timeout_s: float = 1800.0  # a collective waiting longer ends the run, naming the rank that is behind


@dataclasses.dataclass
class CheckpointConfig:
    """``checkpoint``: the cadence of resumable checkpoints (`cookbook.checkpoint`) and where a run resumes."""

    every_steps: int = 500  # -1: never; 0: only at the end and at train.stop_at_step; N: also every N steps
    keep_last: int = 2  # newest checkpoints kept; 0 keeps all
    resume: str = "auto"  # auto (the newest complete checkpoint, if any), none, or a checkpoint folder


@dataclasses.dataclass
class HFCheckpointConfig(CheckpointConfig):
    """``checkpoint`` of a recipe whose final model is a Hugging Face model folder."""

    export_hf: bool = True  # write <output_dir>/final in Hugging Face format (from_pretrained reads it)
    push_to_hub: str = ""  # a Hub repo id (org/name): upload the final export there, with a model card (cookbook.push)


# The linear layers of a Llama-style decoder layer (attention and gated MLP): LoRA on all of them.
DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass
class LoraConfig:
    """``lora``: LoRA (Hu et al. 2021): each targeted W (out x in) trains W + (alpha / r) B A; A: r x in, B: out x r."""

    r: int = 16  # rank of A and B
    alpha: int = 32  # the update is scaled by alpha / r
    dropout: float = 0.0  # on the adapter's input, in [0, 1)
    target_modules: list[str] = dataclasses.field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])

    def peft_kwargs(self) -> dict[str, Any]:
        """The settings as `peft.LoraConfig` (and Unsloth's ``get_peft_model``) name them."""
        return dict(
            r=self.r, lora_alpha=self.alpha, lora_dropout=self.dropout, target_modules=list(self.target_modules)
        )


@dataclasses.dataclass
class ExpertLoraConfig(LoraConfig):
    """``lora`` of a mixture-of-experts recipe, plus ``target_parameters``: fused 3-D expert weights PEFT adapts."""

    target_parameters: list[str] = dataclasses.field(default_factory=list)

    def peft_kwargs(self) -> dict[str, Any]:
        """`LoraConfig.peft_kwargs` with ``target_parameters``; an empty list is ``None`` for PEFT."""
        return {
            **super().peft_kwargs(),
            "target_modules": list(self.target_modules) or None,
            "target_parameters": list(self.target_parameters) or None,
        }


@dataclasses.dataclass
class RunConfig:
    """The top level of a recipe's schema (a recipe's ``Config`` subclasses it): output, tracking, shared sections."""

    output_dir: str = "outputs/run"  # checkpoints, metrics.jsonl, MLflow store, the exported model
    run_name: str = "run"  # the trackers' run name
    mlflow: bool = True  # false: no MLflow, whatever `trackers` says
    trackers: list[str] = dataclasses.field(default_factory=lambda: ["mlflow"])  # beside metrics.jsonl: TRACKERS
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)


# Settings of the shared sections that may differ between a checkpoint and the run that resumes it.
MAY_CHANGE = (
    "output_dir",
    "run_name",
    "mlflow",
    "trackers",
    "train.stop_at_step",
    "train.log_every",
    "train.eval_every",
    "train.profile_step",
    "train.on_nonfinite",
    "train.max_consecutive_skips",
    "train.collective_timeout_s",
    "checkpoint.*",
)


# check_run's lower bounds of the shared keys, and the notes that end their messages.
_MINIMUM = {
    "train.micro_batch_size": 1,
    "train.grad_accum_steps": 1,
    "train.log_every": 1,
    "train.eval_every": 0,
    "optim.max_grad_norm": 0,
    "train.max_steps": -1,
    "train.profile_step": 0,
    "data.num_workers": 0,
    "optim.weight_decay": 0,
    "optim.eps": 0,
    "checkpoint.every_steps": -1,
    "checkpoint.keep_last": 0,
}
_WITHIN = {"optim.lr": "(0, inf)", "optim.warmup_ratio": "[0, 1]"}
_NOTES = {
    "checkpoint.every_steps": "-1: never",
    "optim.max_grad_norm": "0: no clipping",
    "checkpoint.keep_last": "0: keep all",
    "train.max_steps": "-1: train.epochs decides",
    "train.profile_step": "0: none",
    "data.num_workers": "0: load in the training process",
}


# transformers' SchedulerType values (tests/test_config_checks.py compares): importing it in the launcher's check would
# import transformers.trainer_utils and with it peft, a second of the check's start-up on the critical path
SCHEDULERS = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "reduce_lr_on_plateau",
    "cosine_with_min_lr",
    "cosine_warmup_with_min_lr",
    "warmup_stable_decay",
    "greedy",
)


def check_run(cfg: Any) -> None:
    """Check the keys of the shared sections that `cfg` has. Raises ConfigError: a value out of range or unknown; no
    positive length; ``train.stop_at_step`` without checkpoints; an unwritable ``output_dir``; a bad tracker or
    ``push_to_hub``. AlreadyComplete: in a launcher's check, ``output_dir`` holds a run finished with these settings."""
    one_of: dict[str, Iterable[Any]] = {"train.mixed_precision": ("bf16", "fp32"), "optim.scheduler": SCHEDULERS}
    if _has(cfg, "optim.scheduler") and importlib.util.find_spec("torchvision") is not None:
        import torchvision  # noqa: F401 (get_scheduler imports it: a build for another torch is one line, here)
    check_fields(
        cfg,
        at_least={k: v for k, v in _MINIMUM.items() if _has(cfg, k)},
        one_of={k: v for k, v in one_of.items() if _has(cfg, k)},
        within={k: v for k, v in _WITHIN.items() if _has(cfg, k)},
        notes=_NOTES,
    )
    if _has(cfg, "optim.betas") and (len(cfg.optim.betas) != 2 or not all(0 <= b < 1 for b in cfg.optim.betas)):
        raise ConfigError(f"optim.betas must be two numbers in [0, 1), got {list(cfg.optim.betas)}")
    if _has(cfg, "train.max_steps") and cfg.train.max_steps <= 0 and getattr(cfg.train, "epochs", 0) <= 0:
        raise ConfigError("set train.max_steps > 0 or train.epochs > 0")
    stops = _has(cfg, "train.stop_at_step") and _has(cfg, "checkpoint.every_steps") and cfg.train.stop_at_step > 0
    if stops and cfg.checkpoint.every_steps == -1:
        raise ConfigError("train.stop_at_step needs a checkpoint to resume from: checkpoint.every_steps=-1 saves none")
    if _has(cfg, "trackers"):
        check_trackers(cfg.trackers if getattr(cfg, "mlflow", True) else [t for t in cfg.trackers if t != "mlflow"])
    if _has(cfg, "checkpoint.push_to_hub") and cfg.checkpoint.push_to_hub:
        push.check_push(cfg.checkpoint)
    if _has(cfg, "output_dir") and isinstance(cfg.output_dir, str) and "://" not in cfg.output_dir:
        report_output_dir(cfg.output_dir)  # the launcher takes the folder's run lock before any worker starts
        if os.environ.get(OUTPUT_DIR_FILE_ENV):  # a launcher's check: a finished run's command is answered at once
            done = complete_message(cfg.output_dir, to_dict(cfg), MAY_CHANGE)
            if done is not None:
                report_complete()
                raise AlreadyComplete(done)
        out = Path(cfg.output_dir).expanduser()
        probed = set()
        for folder in (out, out / "checkpoints"):
            while not os.path.lexists(folder) and folder != folder.parent:  # the run creates the rest
                folder = folder.parent
            if folder in probed:
                continue
            probed.add(folder)
            try:
                with tempfile.TemporaryFile(prefix=".write-probe-", dir=folder) as f:
                    f.write(b"probe")
                    f.flush()
            except OSError as exc:
                what = "is not a folder" if exc.errno == errno.ENOTDIR else "cannot be written to"
                raise ConfigError(
                    f"output_dir={cfg.output_dir!r}: {folder} {what} ({exc.strerror}, "
                    f"{errno.errorcode.get(exc.errno, exc.errno)}); set output_dir to a folder this user "
                    f"can write to"
                ) from None


def _has(cfg: Any, key: str) -> bool:
    try:
        field_value(cfg, key)
    except ConfigError:
        return False
    return True
