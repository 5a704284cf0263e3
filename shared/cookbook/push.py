"""The Hugging Face Hub as a run's last sink: ``checkpoint.push_to_hub`` checked before any worker starts
(`check_push`, from `cookbook.config.check_run`) and the final export uploaded with a model card (`push_to_hub`,
from `cookbook.metrics`)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Mapping

from cookbook.errors import EXIT_USER_ERROR, ConfigError, OneLineError

PUSHED = ("export_dir", "merged_dir", "adapter_dir")  # the export pushed: the first of these a run wrote
_KEY = "checkpoint.push_to_hub"  # the config key the messages name
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # org/name, the shape of a hub id (validate_repo_id checks more)


def looks_like_hub_id(value: str) -> bool:
    """Whether `value` has the shape of a Hugging Face Hub id (``org/name``) and is not a path on disk."""
    return bool(value) and _HUB_ID.fullmatch(value) is not None and not Path(value).exists()


class HubPushError(OneLineError):
    """The upload of ``checkpoint.push_to_hub`` failed; the export on disk is complete. Exit status 2 (no restart)."""

    __module__ = "cookbook.hub"
    exit_status = EXIT_USER_ERROR


def check_push(checkpoint: Any) -> None:
    """ConfigError for a ``push_to_hub`` that cannot work: not ``org/name``; no export; ``HF_HUB_OFFLINE``; no token."""
    from huggingface_hub import constants, get_token
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    repo_id = checkpoint.push_to_hub
    try:
        validate_repo_id(repo_id)
        if "/" not in repo_id:
            raise HFValidationError("it has no owner")
    except HFValidationError as exc:
        raise ConfigError(
            f"{_KEY}={repo_id!r} is not a Hugging Face Hub repo id (org/name): {str(exc).splitlines()[0]}"
        ) from None
    exports = [
        getattr(checkpoint, k) for k in ("export_hf", "export_adapter", "export_merged") if hasattr(checkpoint, k)
    ]
    if exports and not any(exports):
        raise ConfigError(
            f"{_KEY}={repo_id}: nothing to push, the run exports no model (checkpoint.export_hf or "
            f"checkpoint.export_adapter is false)"
        )
    if constants.HF_HUB_OFFLINE:
        raise ConfigError(f"{_KEY}={repo_id}: HF_HUB_OFFLINE is set; unset it to push, or leave {_KEY} empty")
    if get_token() is None:
        raise ConfigError(f"{_KEY}={repo_id}: no Hugging Face token; log in (`hf auth login`) or set HF_TOKEN")


def _model_card(repo_id: str, config: Mapping[str, Any], metrics: Mapping[str, float], folder: Path) -> str:
    """The ``README.md`` of a pushed export: Hub metadata, the final `metrics`, how to load it, the run's config."""
    from huggingface_hub import ModelCard, ModelCardData
    from omegaconf import OmegaConf

    adapter = (folder / "adapter_config.json").is_file()
    base = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path") if adapter else None
    model = config.get("model", {}) if isinstance(config.get("model"), Mapping) else {}
    if base is None and model.get("pretrained", True) and looks_like_hub_id(str(model.get("name_or_path") or "")):
        base = model["name_or_path"]
    data = ModelCardData(
        library_name="peft" if adapter else "transformers",
        base_model=base or None,
        tags=["distributed-training-cookbook", str(config.get("run_name", "run"))],
    )
    load = (
        f"from peft import AutoPeftModel\nmodel = AutoPeftModel.from_pretrained({repo_id!r})"
        if adapter
        else f"from transformers import AutoModel\nmodel = AutoModel.from_pretrained({repo_id!r})  # or the task's "
        f"AutoModelFor... class"
    )
    rows = "\n".join(f"| {k} | {v:.6g} |" for k, v in metrics.items())
    body = (
        f"# {repo_id}\n\nTrained with the distributed training cookbook (run `{config.get('run_name', 'run')}`)"
        f"{f', from {base}' if base else ''}.\n\n## Final metrics\n\n| metric | value |\n|---|---|\n{rows}\n\n"
        f"## Load\n\n```python\n{load}\n```\n\n## Config\n\n```yaml\n{OmegaConf.to_yaml(OmegaConf.create(dict(config)))}```\n"
    )
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}"))


def push_to_hub(repo_id: str, folder: str | Path, config: Mapping[str, Any], metrics: Mapping[str, float]) -> str:
    """Write the model card into `folder` and upload it to the model repo `repo_id` (created if missing); returns the
    commit's URL. Raises HubPushError: one line with the reason and the retry command."""
    from huggingface_hub import HfApi

    folder = Path(folder)
    (folder / "README.md").write_text(_model_card(repo_id, config, metrics, folder))
    api = HfApi()
    try:
        api.create_repo(repo_id, repo_type="model", exist_ok=True)
        commit = api.upload_folder(
            repo_id=repo_id,
            folder_path=str(folder),
            repo_type="model",
            commit_message=f"{config.get('run_name', 'run')}: final export",
        )
    except Exception as exc:  # noqa: BLE001 - network, authentication, permissions: one line either way
        raise HubPushError(
            f"{_KEY}={repo_id}: the upload of {folder} failed ({type(exc).__name__}: "
            f"{(str(exc).splitlines() or [''])[0]}); the export is complete on disk: retry with "
            f"`hf upload {repo_id} {folder} .`"
        ) from None
    return str(getattr(commit, "commit_url", commit))
