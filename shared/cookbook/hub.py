"""Model folders on disk, from a local path or a Hugging Face Hub id.

Recipes that read safetensors files themselves (shard by shard, without ``from_pretrained``) need a
folder; ``model_folder`` gives one for a local folder or a hub id, the latter through
``huggingface_hub.snapshot_download`` (https://huggingface.co/docs/huggingface_hub/guides/download), so
the usual environment applies: ``HF_HUB_CACHE`` / ``HF_HOME`` choose the cache, ``HF_HUB_OFFLINE=1``
uses the cache only, ``HF_TOKEN`` authenticates for gated models. A model already in the cache is not
downloaded again.
"""

from __future__ import annotations

from pathlib import Path

from cookbook.config import ConfigError

WEIGHT_FILES = ("*.json", "*.safetensors")  # config.json, the safetensors index and shards


def model_folder(name_or_path: str, key: str = "model.name_or_path") -> Path:
    """The local folder holding ``config.json`` and the ``*.safetensors`` weights of a model.

    Args:
        name_or_path: a folder, or a Hugging Face Hub id (``Qwen/Qwen3-8B``), downloaded into the hub
            cache when it is not there (only ``*.json`` and ``*.safetensors`` files).
        key: the config key the value came from, for messages.

    Returns:
        The folder: `name_or_path` itself, or the cached snapshot
        (``<HF_HUB_CACHE>/models--<org>--<name>/snapshots/<revision>``).

    Raises:
        ConfigError: one line naming `key`: a path-like value (absolute, ``./``, ``../``, ``~``) that is not
            a folder; not a valid hub id; a model the hub does not have or one that is gated; a model
            not in the cache when ``HF_HUB_OFFLINE=1`` or the hub cannot be reached; a folder without
            ``*.safetensors`` files.
    """
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        if path.is_absolute() or name_or_path.startswith(("./", "../", "~")) or path.exists():
            raise ConfigError(f"{key}: folder not found: {name_or_path}")
        path = _download(name_or_path, key)
    if not any(path.glob("*.safetensors")):
        raise ConfigError(f"{key}: no *.safetensors files in {path}; this recipe reads weights in the safetensors "
                          f"format (convert *.bin checkpoints with transformers' save_pretrained)")
    return path


def _download(repo_id: str, key: str) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError

    cache = constants.HF_HUB_CACHE
    try:
        return Path(snapshot_download(repo_id, allow_patterns=list(WEIGHT_FILES)))
    except HFValidationError:
        raise ConfigError(f"{key}: {repo_id!r} is not a folder and not a Hugging Face Hub id (org/name)") from None
    except GatedRepoError:
        raise ConfigError(f"{key}: {repo_id} is gated on the Hugging Face Hub: accept its licence on the model page "
                          f"and log in (`hf auth login` or HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise ConfigError(f"{key}: {repo_id!r} is not a folder and not a model on the Hugging Face Hub") from None
    except LocalEntryNotFoundError as exc:
        if constants.HF_HUB_OFFLINE:
            raise ConfigError(f"{key}: {repo_id} is not a folder and not in the Hugging Face cache {cache} "
                              f"(HF_HUB_OFFLINE=1): download it there first (`hf download {repo_id}`) or give a local "
                              f"folder") from None
        raise ConfigError(f"{key}: {repo_id} is not in the Hugging Face cache {cache} and could not be downloaded: "
                          f"{str(exc).splitlines()[0]}") from None
    except OSError as exc:  # e.g. an incomplete cached snapshot offline, a full disk
        raise ConfigError(f"{key}: cannot get {repo_id} into the Hugging Face cache {cache}: "
                          f"{str(exc).splitlines()[0]}") from None
