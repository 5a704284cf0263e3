"""The Criteo text files, written once: a local CSV / JSON / JSONL / parquet file (`file_to_text`) or a hub data set's
split (`dataset_to_text`) as one line a row, renamed into place when complete (`write_lines`)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from cookbook.errors import ConfigError, not_a_file
from cookbook.hub import prepare_access
from cookbook.tabular import DataError, first_csv_row, records


def write_lines(dst: str | Path, lines: Iterable[str], max_lines: int = 0) -> int:
    """Write `lines` (each ending in a newline, consumed lazily; at most `max_lines`, 0: all) to `dst` through
    ``<dst>.<pid>.tmp``, renamed into place at the end; returns the number written."""
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


def dataset_to_text(
    hub_id: str,
    split: str,
    dst: str | Path,
    to_line: Callable[[Mapping[str, Any], str], str],
    columns: Sequence[str] = (),
    max_rows: int = 0,
    version: int = 1,
    key: str = "data.hub_id",
) -> int | None:
    """Write the rows of a hub data set split to `dst` once, streamed, each as ``to_line(row, where)``
    (`where`: ``"<key>=<hub_id> row 7"``). A record ``<dst stem>.json`` (data set, split, `max_rows`, `version`,
    rows) beside it: when it matches, nothing is read. Returns the rows written, or None when `dst` held them.
    Raises DataError: the data set lacks some of `columns`, or `to_line` raised; `dst` is then left as it was."""
    dst = Path(dst)
    record = dst.with_suffix(".json")
    wanted = {"hub_id": hub_id, "split": split, "max_rows": max_rows, "format": version}
    if dst.is_file() and record.is_file():
        written = json.loads(record.read_text())
        if {k: written.get(k) for k in wanted} == wanted:
            return None

    prepare_access()
    import datasets

    def lines():
        for n, row in enumerate(datasets.load_dataset(hub_id, split=split, streaming=True), 1):
            missing = [c for c in columns if c not in row] if n == 1 else []
            if missing:
                raise DataError(
                    f"{key}={hub_id}: the data set has no column(s) {', '.join(missing)} "
                    f"(found {', '.join(sorted(row))})"
                )
            yield to_line(row, f"{key}={hub_id} row {n}")

    n = write_lines(dst, lines(), max_rows)
    record.write_text(json.dumps({**wanted, "rows": n}))
    return n


def file_to_text(
    path: str | Path,
    folder: str | Path,
    to_line: Callable[[Mapping[str, Any], str, Mapping[str, int] | None], str],
    columns: Sequence[str],
) -> tuple[Path, int | None]:
    """A local CSV, JSON, JSONL or parquet file written once as ``<folder>/<stem>-<sha256[:16]>.txt``, one line
    a row by ``to_line(row, where, positions)``; reused while the source is unchanged. Rows: `cookbook.tabular.records`
    (a CSV header names `columns`, or no header and exactly `columns`). Returns the file and the rows written (None:
    it existed).
    Raises ConfigError: `path` does not exist; DataError: a missing column or field, an extra field, or what `to_line`
    raises; no text file is left."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(not_a_file(path, "data file"))
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
