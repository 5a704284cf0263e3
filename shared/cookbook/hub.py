"""Model folders and data files on disk, from a local path or the Hugging Face Hub.

Recipes that read safetensors files themselves (shard by shard, without ``from_pretrained``) need a
folder; ``model_folder`` gives one for a local folder or a hub id, the latter through
``huggingface_hub.snapshot_download`` (https://huggingface.co/docs/huggingface_hub/guides/download), so
the usual environment applies: ``HF_HUB_CACHE`` / ``HF_HOME`` choose the cache, ``HF_HUB_OFFLINE=1``
uses the cache only, ``HF_TOKEN`` authenticates for gated models. A model already in the cache is not
downloaded again.

Recipes whose data loader streams a local text format (one row a line) read other sources through
it: ``dataset_to_text`` writes the rows of a hub data set once, in the recipe's own line format, to a
file beside a record of what was written, and ``file_to_text`` does the same for a local CSV, JSON,
JSONL or parquet file, keyed by its content. Later runs (and every rank) read those files offline.
``write_lines`` is the atomic write both use.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from cookbook.config import ConfigError
from cookbook.tabular import DataError, first_csv_row, records

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


def write_lines(dst: str | Path, lines: Iterable[str], max_lines: int = 0) -> int:
    """Write `lines` (each ending in a newline) to `dst` through a temporary file beside it, renamed into
    place at the end, so that an interrupted or refused write never looks complete.

    Args:
        dst: the file to write; its folder is created. The temporary file is ``<dst>.<pid>.tmp``, so
            processes that write the same file at once do not collide.
        lines: the lines, consumed lazily (an error raised while producing them leaves `dst` as it was).
        max_lines: stop after this many lines (``0``: all).

    Returns:
        The number of lines written.
    """
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f"{dst.name}.{os.getpid()}.tmp")
    n = 0
    try:
        with open(tmp, "w") as f:
            for line in lines:
                f.write(line)
                n += 1
                if n == max_lines:
                    break
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    return n


def dataset_to_text(hub_id: str, split: str, dst: str | Path, to_line: Callable[[Mapping[str, Any], str], str],
                    columns: Sequence[str] = (), max_rows: int = 0, version: int = 1,
                    key: str = "data.hub_id") -> int | None:
    """Write the rows of a Hugging Face data set split to a local text file, once.

    The rows are streamed (``datasets.load_dataset(hub_id, split=split, streaming=True)``) and each is
    written as ``to_line(row, where)`` with `write_lines`. Beside `dst`, ``<dst stem>.json`` records the
    data set, split, `max_rows`, `version` and the number of rows; when that record matches the
    arguments, `dst` is left as it is and nothing is read from the hub (a file without a record, or one
    written by another `version` of `to_line`, is written again).

    Args:
        hub_id: the data set (``org/name``); reached through the usual Hugging Face environment
            (``HF_HOME``, ``HF_HUB_OFFLINE``, ``HF_TOKEN``).
        split: the split to write (``train``).
        dst: the text file to write.
        to_line: one row (column name -> value) as a line ending in a newline; `where` is
            ``"<key>=<hub_id> row 7"`` (1-based), for its error messages.
        columns: the columns every row needs; checked on the first row.
        max_rows: write the first this many rows (``0``: all).
        version: the version of `to_line`'s format; raise it when the format changes.
        key: the config key that named `hub_id`, for messages.

    Returns:
        The number of rows written, or ``None`` when `dst` already held them.

    Raises:
        DataError: the data set lacks some of `columns` (named, with the columns it has), or whatever
            `to_line` raises for a malformed row; `dst` and its record are then left as they were.
    """
    dst = Path(dst)
    record = dst.with_suffix(".json")
    wanted = {"hub_id": hub_id, "split": split, "max_rows": max_rows, "format": version}
    if dst.is_file() and record.is_file():
        written = json.loads(record.read_text())
        if {k: written.get(k) for k in wanted} == wanted:
            return None

    import datasets

    def lines():
        for n, row in enumerate(datasets.load_dataset(hub_id, split=split, streaming=True), 1):
            missing = [c for c in columns if c not in row] if n == 1 else []
            if missing:
                raise DataError(f"{key}={hub_id}: the data set has no column(s) {', '.join(missing)} "
                                f"(found {', '.join(sorted(row))})")
            yield to_line(row, f"{key}={hub_id} row {n}")

    n = write_lines(dst, lines(), max_rows)
    record.write_text(json.dumps({**wanted, "rows": n}))
    return n


def file_to_text(path: str | Path, folder: str | Path,
                 to_line: Callable[[Mapping[str, Any], str, Mapping[str, int] | None], str],
                 columns: Sequence[str]) -> tuple[Path, int | None]:
    """A local CSV, JSON, JSONL or parquet file written once as text, one line a row, keyed by its content.

    The text file is ``<folder>/<stem>-<first 16 hex digits of the file's sha256>.txt``; when it exists
    it is reused, and a changed source gets another name and is written again. The source is read once
    to hash it (sha256, about 1 GB/s). Rows come from `cookbook.tabular.records`: a CSV file has a header
    naming `columns` (any order, any case; other columns ignored) or, when no field of its first row is
    one of `columns`, no header and exactly `columns` in that order.

    Args:
        path: the source file.
        folder: where the text file goes (created).
        to_line: ``(row, where, positions)`` -> one line ending in a newline. `row`: column name -> value;
            `where`: ``"<file> line 7"`` (CSV, JSONL) or ``"<file> row 7"`` (JSON array, parquet);
            `positions`: column name -> 1-based column of a CSV file (``None`` for other formats), for messages.
        columns: the columns every row needs, in the order of a CSV file without a header.

    Returns:
        The text file, and the number of rows written (``None``: it existed).

    Raises:
        ConfigError: `path` does not exist.
        DataError: a missing column, a row with an extra or a missing field (naming file, line or row), or
            whatever `to_line` raises; no text file is left then.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"data file not found: {path}")
    with open(p, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    dst = Path(folder) / f"{p.stem}-{digest[:16]}.txt"
    if dst.is_file():
        return dst, None
    kw: dict[str, Any] = {}
    positions = None
    if p.suffix.lower() == ".csv":
        first = first_csv_row(p) or []
        canonical = {c.lower(): c for c in columns}
        header = [canonical.get(c.strip().lower(), c.strip()) for c in first]
        headerless = not set(header) & set(columns)
        kw = dict(csv_columns=list(columns) if headerless else header, csv_header=not headerless)
        positions = {c: i for i, c in enumerate(kw["csv_columns"], 1)}
    rows = records(p, required=columns, **kw)
    return dst, write_lines(dst, (to_line(row, where, positions) for where, row in rows))
