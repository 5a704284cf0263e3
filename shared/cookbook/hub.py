"""Model folders from a local path or the Hugging Face Hub (``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``, ``HF_TOKEN`` apply).
`resolve_path` calls `prepare_access` (one reachability check, the download bars:
docs/notes.md#the-hub-without-a-network-huggingface_hub-1x) before a hub id's first use; `model_folder`;
`check_local_model`."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

from cookbook import config
from cookbook.errors import ConfigError
from cookbook.progress import is_terminal
from cookbook.push import looks_like_hub_id

_reachable: bool | None = None  # this process's answer, once asked


def offline_unless_reachable(timeout_s: float = 3.0) -> bool:
    """Unless ``HF_HUB_OFFLINE`` is set, ask the hub once (at most `timeout_s`); without an answer switch this
    process to offline mode (rank 0 says so). Returns True when the process is offline (before, or now)."""
    global _reachable
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return True
    if _reachable is None:
        endpoint, answer = constants.ENDPOINT, {}

        def ask() -> None:
            from huggingface_hub.utils import get_session

            try:
                get_session().head(endpoint, timeout=timeout_s)
                answer["ok"] = True
            except Exception as exc:  # noqa: BLE001 - any failure to get an answer
                answer["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")

        asker = threading.Thread(target=ask, daemon=True)  # a hung DNS lookup is not bounded by the HTTP timeout
        asker.start()
        asker.join(timeout_s)
        _reachable = bool(answer.get("ok"))
        if not _reachable:  # as HF_HUB_OFFLINE=1 at the start would: huggingface_hub's constant and datasets' copy
            constants.HF_HUB_OFFLINE = True
            datasets_config = sys.modules.get("datasets.config")
            if datasets_config is not None and hasattr(datasets_config, "HF_HUB_OFFLINE"):
                datasets_config.HF_HUB_OFFLINE = True
            if os.environ.get("RANK", "0") == "0":
                why = answer.get("error") or f"no answer within {timeout_s:g} s"
                print(
                    f"warning: the Hugging Face Hub ({endpoint}) cannot be reached ({why}): working offline, from "
                    f"the cache {constants.HF_HUB_CACHE} only (set HF_HUB_OFFLINE=1 to skip this check)",
                    file=sys.stderr,
                )
    return not _reachable


def show_download_bars() -> bool:
    """Turn huggingface_hub's download bars on (local rank 0, stderr a terminal); returns whether they are on."""
    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars

    turned_off = "HF_HUB_DISABLE_PROGRESS_BARS" in os.environ
    if os.environ.get("LOCAL_RANK", "0") == "0" and is_terminal(sys.stderr) and not turned_off:
        enable_progress_bars("huggingface_hub")
    return not are_progress_bars_disabled("huggingface_hub.http_get")


def prepare_access() -> None:
    """Before a hub id's first use: `offline_unless_reachable`, then `show_download_bars` when the hub answers."""
    if not offline_unless_reachable():
        show_download_bars()


_DATA_SUFFIXES = (".csv", ".tsv", ".json", ".jsonl", ".parquet", ".txt", ".yaml", ".yml")


def resolve_path(value: str, base_dir: str | Path) -> str:
    """`cookbook.config.resolve_path`; a value left as a hub id calls `prepare_access` first."""
    resolved = config.resolve_path(value, base_dir)
    if resolved == value and Path(value).suffix.lower() not in _DATA_SUFFIXES and looks_like_hub_id(value):
        prepare_access()  # (a missing data file is said as such, without a hub probe first)
    return resolved


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def check_local_model(value: str, key: str, tokenizer: bool = False) -> None:
    """Raise ConfigError naming `key` when `value` names a local path (absolute, ``./``, ``../``, ``~`` or existing)
    that is not a folder with ``config.json`` (`tokenizer`: with one of `_TOKENIZER_FILES`); a hub id passes."""
    path = Path(value).expanduser()
    if not (path.exists() or value.startswith(("/", "./", "../", "~"))):
        return
    if not path.is_dir():
        raise ConfigError(f"{key}: {'not a folder' if path.exists() else 'folder not found'}: {value}")
    wanted = _TOKENIZER_FILES if tokenizer else ("config.json",)
    if not any((path / name).is_file() for name in wanted):
        what = "tokenizer" if tokenizer else "model"
        raise ConfigError(f"{key}: {value} is not a Hugging Face {what} folder (none of {', '.join(wanted)} in it)")


def model_folder(name_or_path: str, key: str = "model.name_or_path") -> Path:
    """The local folder of ``config.json`` and ``*.safetensors``: `name_or_path`, or the hub cache's snapshot of it.
    Raises ConfigError naming `key`: a path-like value not a folder; no valid, reachable, ungated hub id; not in the
    cache while offline; no ``*.safetensors``."""
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        if path.is_absolute() or name_or_path.startswith(("./", "../", "~")) or path.exists():
            raise ConfigError(f"{key}: folder not found: {name_or_path}")
        path = _download(name_or_path, key)
    if not any(path.glob("*.safetensors")):
        raise ConfigError(
            f"{key}: no *.safetensors files in {path}; this recipe reads weights in the safetensors "
            f"format (convert *.bin checkpoints with transformers' save_pretrained)"
        )
    return path


def _download(repo_id: str, key: str) -> Path:
    from huggingface_hub import constants, errors, snapshot_download

    cache = constants.HF_HUB_CACHE
    prepare_access()
    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors"]))
    except errors.HFValidationError:
        raise ConfigError(f"{key}: {repo_id!r} is not a folder and not a Hugging Face Hub id (org/name)") from None
    except errors.GatedRepoError:
        raise ConfigError(
            f"{key}: {repo_id} is gated on the Hugging Face Hub: accept its licence on the model page "
            f"and log in (`hf auth login` or HF_TOKEN)"
        ) from None
    except errors.RepositoryNotFoundError:
        raise ConfigError(f"{key}: {repo_id!r} is not a folder and not a model on the Hugging Face Hub") from None
    except errors.LocalEntryNotFoundError as exc:
        if constants.HF_HUB_OFFLINE:
            asked = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE")
            why = "HF_HUB_OFFLINE=1" if asked else "the Hugging Face Hub cannot be reached"
            raise ConfigError(
                f"{key}: {repo_id} is not a folder and not in the Hugging Face cache {cache} "
                f"({why}): download it there first (`hf download {repo_id}`) or give a local "
                f"folder"
            ) from None
        raise ConfigError(
            f"{key}: {repo_id} is not in the Hugging Face cache {cache} and could not be downloaded: "
            f"{str(exc).splitlines()[0]}"
        ) from None
    except OSError as exc:  # e.g. an incomplete cached snapshot offline, a full disk
        raise ConfigError(
            f"{key}: cannot get {repo_id} into the Hugging Face cache {cache}: {str(exc).splitlines()[0]}"
        ) from None
