"""Rows of tabular files (CSV, TSV, JSON / JSONL, parquet) with their place in the file: ``records(path, required)``
yields ``(where, row)``, ``where`` ``"<path> line <n>"`` (CSV, TSV, JSONL) or ``"<path> row <n>"`` (JSON array,
parquet). A BOM, CRLF, quoted fields and blank lines are accepted; anything else is one `DataError` naming file,
line or row and field. `to_int`: ``"3"``, ``"3.0"``, 3 and 3.0 are all 3."""

from __future__ import annotations

import csv
import json
import math
import numbers
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from cookbook.errors import not_a_file

_CSV, _JSON, _PARQUET = (".csv", ".tsv"), (".json", ".jsonl"), (".parquet",)  # a .tsv is CSV split on tabs


class DataError(ValueError):
    """A data file is missing or malformed; the message names the file, the line (or row) and the field."""


def _columns(names: Sequence[str]) -> str:
    """``label, title, description``; a long list is shortened to ``label, I1, ..., C26``."""
    return ", ".join(names) if len(names) <= 8 else f"{names[0]}, {names[1]}, ..., {names[-1]}"


def not_utf8(path: Path, exc: UnicodeDecodeError) -> DataError:
    """The error for a file that is not UTF-8, naming the first line that does not decode."""
    with open(path, "rb") as f:  # "replace" and "ignore" differ only where bytes do not decode
        line = next((n for n, b in enumerate(f, 1) if b.decode(errors="replace") != b.decode(errors="ignore")), None)
    return DataError(f"{path}{f' line {line}' if line else ''}: not UTF-8 text ({exc.reason}); save it as UTF-8")


def read_text(path: Path, error: type[ValueError] = DataError) -> str:
    """The text of `path`, a byte-order mark dropped; `error` with `not_utf8`'s message if it is not UTF-8."""
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise error(str(not_utf8(path, exc))) from None


def jsonl(path: Path, lines: Iterable[str], error: type[ValueError] = DataError) -> Iterator[tuple[int, Any]]:
    """``(line number, value)`` of the non-blank `lines` of JSONL file `path`; `error`: a line not valid JSON."""
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as exc:
                raise error(f"{path} line {n}: not valid JSON: {exc.msg} (column {exc.colno})") from None


def _csv_lines(path: Path) -> Iterator[tuple[int, int, list[str]]]:
    """(first line, last line, fields) of every non-blank CSV (``.tsv``: TSV) record."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader, end = csv.reader(f, delimiter="\t" if path.suffix.lower() == ".tsv" else ","), 0
            for fields in reader:
                start, end = end + 1, reader.line_num
                if len(fields) > 1 or (fields and fields[0].strip()):  # a blank line is an empty record
                    yield start, end, fields
    except csv.Error as exc:
        raise DataError(f"{path} line {reader.line_num}: not valid CSV: {exc}") from None
    except UnicodeDecodeError as exc:
        raise not_utf8(path, exc) from None


def first_csv_row(path: str | Path) -> list[str] | None:
    """The fields of a CSV / TSV file's first non-blank record, or None; DataError: not UTF-8 or not valid CSV."""
    return next((fields for _, _, fields in _csv_lines(Path(path))), None)


def _csv_records(p: Path, columns: Sequence[str], header: bool) -> Iterator[tuple[str, dict[str, str]]]:
    """``(where, {column: field})`` of a CSV file's rows (a first record skipped with `header`); DataError:
    ``"<path> line <n>: 4 fields, expected 3 (...)"``, ``"... missing field 'description' (2 of 3 fields: ...)"``."""
    lines = _csv_lines(p)
    if header and next(lines, None) is None:
        return
    width = len(columns)
    for line, last, fields in lines:
        where = f"{p} line {line}"
        quote = f"; a quoted field there runs to line {last}: is a quote unclosed?" if last > line else ""
        if len(fields) > width:
            raise DataError(f"{where}: {len(fields)} fields, expected {width} ({_columns(columns)}){quote}")
        if len(fields) < width:
            raise DataError(
                f"{where}: missing field '{columns[len(fields)]}' ({len(fields)} of {width} fields: "
                f"{_columns(columns)}){quote}"
            )
        yield where, dict(zip(columns, fields))


def _json_records(p: Path, required: Sequence[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, object)`` of a JSON array or JSONL; DataError: not UTF-8 or JSON, not an object, no `required` field."""
    text = read_text(p)
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"{p}: not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") from None
        numbered = ((f"{p} row {n}", row) for n, row in enumerate(rows, 1))
    else:
        numbered = ((f"{p} line {n}", row) for n, row in jsonl(p, text.splitlines()))  # LF, CRLF and CR alike
    for where, row in numbered:
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
        for c in required:
            if c not in row:
                raise DataError(f"{where}: missing field '{c}' (found {', '.join(row) or 'none'})")
        yield where, row


def _parquet(p: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(p)
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"{p}: not a parquet file: {exc}") from None


def _check_columns(p: Path, required: Sequence[str], found: Sequence[str]) -> None:
    missing = [c for c in required if c not in found]
    if missing:
        raise DataError(f"{p}: no column(s) {', '.join(missing)} (found {_columns(found)})")


def _parquet_records(p: Path, columns: Sequence[str] | None) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, {column: value})`` of a parquet file's rows (`columns` only); DataError: not parquet, no column."""
    pf = _parquet(p)
    _check_columns(p, columns or (), pf.schema_arrow.names)
    batches = pf.iter_batches(batch_size=65536, columns=list(columns) if columns is not None else None)
    for n, row in enumerate((row for batch in batches for row in batch.to_pylist()), 1):
        yield f"{p} row {n}", row


def column_names(path: str | Path) -> list[str] | None:
    """The columns of a CSV / TSV (its first record) or parquet file; None for JSON, JSONL. DataError: as `records`."""
    p, suffix = _existing(path)
    if suffix in _CSV:
        return [c.strip() for c in first_csv_row(p) or []]
    return list(_parquet(p).schema_arrow.names) if suffix in _PARQUET else None


def _existing(path: str | Path) -> tuple[Path, str]:
    p = Path(path)
    if not p.is_file():
        raise DataError(not_a_file(p))
    if p.suffix.lower() not in _CSV + _JSON + _PARQUET:
        raise DataError(f"{p}: unsupported file type {p.suffix.lower()!r} (use .csv, .tsv, .json, .jsonl or .parquet)")
    return p, p.suffix.lower()


def records(
    path: str | Path, required: Sequence[str] = (), csv_columns: Sequence[str] | None = None, csv_header: bool = True
) -> Iterator[tuple[str, dict[str, Any]]]:
    """The rows of a CSV, TSV, JSON, JSONL or parquet file (by suffix) as ``(where, {column: value})``; `required`
    columns every row must have (parquet: the only ones read); `csv_columns` (None: the header's), `csv_header`.
    Raises DataError: a missing file or other type; a required column missing; or as the readers above."""
    p, suffix = _existing(path)
    if suffix in _CSV:
        columns = csv_columns
        if columns is None and csv_header:
            columns = column_names(p) or list(required)  # no record: the required columns
        _check_columns(p, required, columns)
        yield from _csv_records(p, columns, csv_header)
    elif suffix in _JSON:
        yield from _json_records(p, required)
    else:
        yield from _parquet_records(p, list(required) or None)  # only the required columns are read


def shown(value: Any) -> str:
    """A field as the user's file wrote it: a string stripped, anything else as JSON (``true``, ``1.5``, ``null``)."""
    return value.strip() if isinstance(value, str) else json.dumps(value)


def to_int(value: Any) -> int | None:
    """An integer written in any usual way (``3``, ``" 3 "``, ``3.0``, ``"3.0"``, ``"3e2"``); None: None, ``""``, NaN.
    Raises ValueError: not a whole number (``"2.5"``, ``inf``, a bool), or outside the int64 range."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is a bool")
    if isinstance(value, numbers.Integral):
        return check_int64(int(value))
    if isinstance(value, str):
        try:
            n = int(value)
        except ValueError:
            value = float(value)  # raises ValueError for text
        else:
            return check_int64(n)
    f = float(value)
    if math.isnan(f):
        return None
    if not f.is_integer():
        raise ValueError(f"{value!r} is not a whole number")
    return check_int64(int(f))


INT64 = (-(2**63), 2**63 - 1)


def check_int64(n: int | None) -> int | None:
    """`n` itself when it fits a 64-bit integer (``torch.int64``); ValueError otherwise."""
    if n is not None and not INT64[0] <= n <= INT64[1]:
        raise ValueError(f"{len(str(abs(n)))}-digit integer is outside the 64-bit range")
    return n
