"""The data of a reference batch: planning it into chunks from metadata, reading a chunk into scoring requests,
writing a chunk's results as one object, and the manifest.

Formats: Parquet (pyarrow), CSV (pyarrow; plain, `.gz` or `.zst`), JSONL (plain, `.gz` or `.zst`). A Parquet
file is planned from its footer (row groups, split into slices of about BATCH_CHUNK_ROWS rows); JSONL and CSV
from their size (byte ranges of BATCH_CHUNK_BYTES; a range's first partial line belongs to the range before
it, so ranges need no data to plan). A compressed file cannot be split: it is one chunk, and files over
BATCH_COMPRESSED_MAX_BYTES are refused. Every read goes through the file interface fsspec gives every store
(read, seek; a remote file's readline takes no size), in blocks of READ_BLOCK_BYTES, so that a remote store
is not asked for its default read-ahead (s3fs: 50 MiB) to plan a header.

A pair table (Parquet, CSV, or JSONL with `columns`: one object per line, as BigQuery and Spark export JSON)
has one row per (query, document): `columns` names the query and item columns, id columns passed through to
the output, and optionally a label column (a list of token ids per row). Adjacent rows with the same query
(and labels) are one request, so the query runs once. A column may also come from the object's folders:
Hive-style partitions (`dt=2026-11-01/part-0.parquet`) give each row of the object that value (a string).
Without `columns`, JSONL lines are the lines of an uploaded batch (a job's fields with `custom_id`, or an
OpenAI Batch line to /v1/score).

A row that cannot be scored (a bad value, too many tokens, an unknown label id) is an output row with
`error_code` and `error_message`; nothing per row goes to the database.
"""

import base64
import datetime
import gzip
import io
import json
import math
import posixpath
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import zstandard

from core import RequestTokenizer, ScoringError, TokenizedRequest, scores_from_logprobs
from store.batches import LineError, parse_line
from store.errors import ServiceError
from store.lake.access import store_error
from store.location import Location
from store.schemas import RerankRequest, check_storable, score_lists
from store.settings import Settings

FORMATS = ("jsonl", "parquet", "csv")
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
# The most rows (items) one request of a pair table takes: a longer run of rows with the same query is split.
MAX_GROUP_ROWS = 1000
# Text files are read in blocks of this size (a header line, the line a byte range starts or ends in).
READ_BLOCK_BYTES = 1 << 16
# A CSV header or a JSONL pair table's first line longer than this is not looked at while planning.
FIRST_LINE_MAX_BYTES = 1 << 20
# Hive's name for a partition whose value is null.
HIVE_NULL = "__HIVE_DEFAULT_PARTITION__"
# What a damaged object raises as it is read or decompressed (besides pyarrow's errors).
CORRUPT = (gzip.BadGzipFile, zlib.error, zstandard.ZstdError, EOFError, UnicodeDecodeError)


class InputError(Exception):
    """A chunk's input cannot be read for good (missing, corrupt): its rows fail with this code. A transient
    failure (the store unreachable) is any other exception: the chunk is tried again."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(frozen=True)
class Columns:
    query: str
    item: str
    ids: tuple[str, ...] = ()
    label: str | None = None

    def names(self) -> list[str]:
        return list(dict.fromkeys([self.query, self.item, *self.ids, *([self.label] if self.label else [])]))


@dataclass(frozen=True)
class Options:
    """A batch's scoring options (every request of it)."""

    format: str
    columns: Columns | None  # pair tables only
    label_token_ids: tuple[int, ...] | None
    apply_softmax: bool = False
    item_first: bool = False
    return_logprobs: bool = False
    output_format: str = "parquet"

    def to_json(self) -> dict:
        return {"format": self.format, "columns": self.columns.__dict__ | {"ids": list(self.columns.ids)}
                if self.columns else None, "label_token_ids": list(self.label_token_ids or []) or None,
                "apply_softmax": self.apply_softmax, "item_first": self.item_first,
                "return_logprobs": self.return_logprobs, "output_format": self.output_format}

    @classmethod
    def from_json(cls, value: dict) -> "Options":
        columns = value.get("columns")
        return cls(value["format"], Columns(columns["query"], columns["item"], tuple(columns.get("ids") or ()),
                                            columns.get("label")) if columns else None,
                   tuple(value["label_token_ids"]) if value.get("label_token_ids") else None,
                   value.get("apply_softmax", False), value.get("item_first", False),
                   value.get("return_logprobs", False), value.get("output_format", "parquet"))


def format_of(location: Location, given: str | None) -> tuple[str, str | None]:
    """(format, compression) from `given` or the object's extension."""
    name = location.name.lower()
    compression = next((c for ext, c in COMPRESSIONS.items() if name.endswith(ext)), None)
    if compression:
        name = name.rsplit(".", 1)[0]
    ext = posixpath.splitext(name)[1].lstrip(".")
    found = {"jsonl": "jsonl", "json": "jsonl", "ndjson": "jsonl", "parquet": "parquet", "pq": "parquet",
             "csv": "csv"}.get(ext)
    fmt = given or found
    if fmt is None:
        raise ServiceError(400, "unknown_format", f"the format of {location.name} is not known from its name: "
                                                  f"give format (one of {', '.join(FORMATS)})")
    if compression and fmt == "parquet":
        raise ServiceError(400, "unsupported_compression", f"{location.name}: a Parquet file is compressed inside; "
                                                           "only JSONL and CSV may be .gz or .zst")
    return fmt, compression


def partitions(location: Location) -> dict[str, str | None]:
    """The Hive-style partition values in an object's folders (`.../dt=2026-11-01/part-0.parquet`)."""
    values: dict[str, str | None] = {}
    for segment in location.path.split("/")[:-1]:
        key, eq, value = segment.partition("=")
        if eq and key:
            value = unquote(value)  # Hive escapes '/', '=' and the like as %XX
            values[unquote(key)] = None if value == HIVE_NULL else value
    return values


@dataclass(frozen=True)
class PlannedChunk:
    """A part of one input object: Parquet rows [start, stop) of row group `part`; JSONL/CSV bytes
    [start, stop) (`part` -1)."""

    input: str
    part: int
    start: int
    stop: int
    rows: int | None  # known for Parquet
    version: str | None = None  # the object's, when planned (object_version)


def object_version(location: Location, info: dict) -> str:
    """The size and version of an object (its store's Store.version), from the store's `info()`: what a worker
    compares with the planned one, since a chunk is a range of rows or bytes of the object as it was when
    planned."""
    return f"{info.get('size')}:{location.store.version(info)}"[:300]


def plan(objects: list[Location], options: Options, settings: Settings) -> Iterator[PlannedChunk]:
    """The chunks of these objects, from metadata only (Parquet footers, object sizes, a CSV's header line, a
    JSONL pair table's first line). A failure of the store or the object is a 4xx naming it (503 while the
    store cannot be reached), never an unexplained error."""
    for location in objects:
        fmt, compression = format_of(location, options.format)
        try:
            yield from _plan_object(location, fmt, compression, options, settings)
        except ServiceError:
            raise
        except Exception as exc:  # noqa: BLE001  (each store's libraries raise their own kinds)
            if _is_corrupt(exc):
                raise ServiceError(400, "input_corrupt", f"{location.name}: not a readable "
                                                         f"{fmt}{' (' + compression + ')' if compression else ''} "
                                                         f"file ({type(exc).__name__}: {exc})") from None
            raise store_error(location, exc) from None


def _plan_object(location: Location, fmt: str, compression: str | None, options: Options,
                 settings: Settings) -> Iterator[PlannedChunk]:
    fs = location.fs
    info = fs.info(location.path)
    version = object_version(location, info)
    if fmt == "parquet":
        with fs.open(location.path, "rb") as f:
            meta = pq.ParquetFile(f).metadata
            _check_columns(location, options, meta.schema.to_arrow_schema().names)
            for group in range(meta.num_row_groups):
                rows = meta.row_group(group).num_rows
                step = max(1, settings.batch_chunk_rows_target)
                for start in range(0, rows, step):
                    yield PlannedChunk(location.uri, group, start, min(rows, start + step),
                                       min(rows, start + step) - start, version)
        return
    size = info["size"]
    if size == 0 and not compression:
        return  # no rows, and no header to check (an export's empty part, beside the others)
    if fmt == "csv":
        _check_columns(location, options, _csv_header(_first_line(fs, location.path, compression)))
    elif options.columns is not None:
        _check_first_object(location, options, _first_line(fs, location.path, compression))
    if compression:
        if size > settings.batch_compressed_max_bytes:
            raise ServiceError(413, "compressed_input_too_large",
                               f"{location.name}: a compressed file is one chunk, at most "
                               f"{settings.batch_compressed_max_bytes} bytes; split it or send it uncompressed")
        yield PlannedChunk(location.uri, -1, 0, size, None, version)
        return
    for start in range(0, size, settings.batch_chunk_bytes):
        yield PlannedChunk(location.uri, -1, start, min(size, start + settings.batch_chunk_bytes), None, version)


def _is_corrupt(exc: BaseException) -> bool:
    """Whether reading failed on the object's bytes (not the store): pyarrow's errors, a damaged compressed
    stream, text that is not UTF-8. pyarrow reports a corrupt Parquet file as an OSError ("Parquet magic bytes
    not found", "Couldn't deserialize thrift"), which the store's own failures (connection errors) are too."""
    if isinstance(exc, (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, *CORRUPT)):
        return True
    store_failure = (FileNotFoundError, PermissionError, ConnectionError, TimeoutError)
    return isinstance(exc, OSError) and not isinstance(exc, store_failure) and \
        any(word in str(exc).lower() for word in ("parquet", "thrift"))


def _check_columns(location: Location, options: Options, names: list[str]) -> None:
    if options.columns is None:
        raise ServiceError(400, "columns_required", f"{location.name}: a {options.format or 'table'} input needs "
                                                    "columns (query, item)")
    names = [*names, *partitions(location)]
    missing = [c for c in options.columns.names() if c not in names]
    if missing:
        raise ServiceError(400, "unknown_column", f"{location.name} has no column {missing[0]!r} "
                                                  f"(it has {', '.join(names[:20])})")


def _check_first_object(location: Location, options: Options, line: bytes) -> None:
    """A JSONL pair table's first line names the columns the others are expected to have: a column it lacks
    is refused now rather than failing every row. A first line that is not an object is left to its row."""
    try:
        value = json.loads(line) if line.strip() else None
    except ValueError:
        return
    if isinstance(value, dict):
        _check_columns(location, options, list(value))


def _first_line(fs: Any, path: str, compression: str | None) -> bytes:
    """The first line of a text object (at most FIRST_LINE_MAX_BYTES), read a block at a time: a remote file's
    readline takes no size, and a file with no line break would be read whole."""
    head = b""
    with fs.open(path, "rb", block_size=READ_BLOCK_BYTES, compression=compression) as f:
        while b"\n" not in head and len(head) < FIRST_LINE_MAX_BYTES:
            block = f.read(READ_BLOCK_BYTES)
            if not block:
                break
            head += block
    return head.split(b"\n", 1)[0][:FIRST_LINE_MAX_BYTES].rstrip(b"\r")


def _csv_header(line: bytes) -> list[str]:
    try:
        return pacsv.read_csv(io.BytesIO(line + b"\n")).column_names if line.strip() else []
    except pa.ArrowInvalid:
        return []


# ---- reading a chunk ---------------------------------------------------------------------------------------


@dataclass
class Pairs:
    """A pair table's rows as read: the named columns' values (a column missing from the object is taken from
    its partition folders), the id columns' types, and the rows known bad as read (a JSONL line that is not
    an object or lacks a column), each with (code, message)."""

    columns: dict[str, list | pa.Array]  # a Parquet or CSV id column as read (only passed through)
    types: dict[str, pa.DataType]
    n_rows: int
    errors: dict[int, tuple[str, str]] = field(default_factory=dict)


@dataclass
class ChunkRows:
    """A chunk read and tokenized: its rows' passthrough values, the requests (each with the rows it covers;
    a pair table's request has one row per item, a JSONL line's one row for all its items) and the rows'
    errors."""

    pair_table: bool
    n_rows: int
    passthrough: dict[str, list | pa.Array]  # column -> value per row (custom_id for JSONL)
    passthrough_types: dict[str, pa.DataType]
    # (rows, request, softmax)
    requests: list[tuple[Sequence[int], TokenizedRequest, bool]] = field(default_factory=list)
    errors: dict[int, tuple[str, str]] = field(default_factory=dict)
    return_logprobs: dict[int, bool] = field(default_factory=dict)  # JSONL rows that asked for them

    @property
    def items(self) -> int:
        return sum(r.n_items for _, r, _ in self.requests)

    def first(self, n: int) -> "ChunkRows":
        """The first n rows (a cut falls between requests)."""
        return ChunkRows(self.pair_table, n, {name: values[:n] for name, values in self.passthrough.items()},
                         self.passthrough_types, [r for r in self.requests if r[0][0] < n],
                         {i: e for i, e in self.errors.items() if i < n},
                         {i: v for i, v in self.return_logprobs.items() if i < n})


def read_chunk(location: Location, part: int, start: int, stop: int, options: Options,
               tokenizer: RequestTokenizer) -> ChunkRows:
    """Reads one chunk and tokenizes it (worker side). Raises InputError when the object is missing or
    corrupt; any other exception is transient."""
    return chunk_requests(read_input(location, part, start, stop, options), options, tokenizer)


def chunk_requests(data: Pairs | list[bytes], options: Options, tokenizer: RequestTokenizer) -> ChunkRows:
    """A chunk's rows (`read_input`) tokenized into requests."""
    try:
        return _lines(data, options, tokenizer) if isinstance(data, list) else _pairs(data, options, tokenizer)
    except (pa.ArrowInvalid, pa.ArrowTypeError, KeyError) as exc:
        raise InputError("input_corrupt", f"the chunk's rows could not be read: {exc}") from None


def read_input(location: Location, part: int, start: int, stop: int, options: Options,
               version: str | None = None) -> Pairs | list[bytes]:
    """A chunk's rows from storage: a pair table's, or JSONL request lines. Raises InputError when the object
    is missing or corrupt, or is no longer the `version` planned; any other exception is transient."""
    try:
        rows = _read_rows(location, part, start, stop, options)
    except Exception:
        # A rewrite can break the read itself (a part that now starts inside a quoted value, the store's
        # If-Match on the old ETag): said as what it is, not as a corrupt object or a store to try again.
        if version is not None and (now := _version_now(location)) not in (None, version):
            raise _changed(location, version, now) from None
        raise
    # Checked after reading too: a rewrite before or during the read that still reads shows here (its bytes
    # at the planned offsets are other rows).
    if version is not None and (now := _version_now(location)) != version:
        raise _changed(location, version, now or "removed")
    return rows


def cut_positions(location: Location, part: int, start: int, options: Options, data: Pairs | list[bytes],
                  rows: list[int]) -> list[int] | None:
    """Where a chunk read by read_input resumes at each of these rows, to cut it there: the row offsets of a
    Parquet row group, the byte offsets of plain JSONL lines. None where a chunk runs whole (CSV, compressed
    JSONL)."""
    if part >= 0:
        return [start + row for row in rows]
    if not isinstance(data, list) or format_of(location, options.format)[1]:
        return None
    begin = 0
    if start > 0:  # where the chunk's first line starts, as read_input found it
        with location.fs.open(location.path, "rb") as f:
            f.seek(start - 1)
            f.readline()
            begin = f.tell()
    offsets, at, row = {}, begin, 0
    wanted = set(rows)
    for line in data:  # read with their line ends; blank lines are no rows
        if line.strip():
            if row in wanted:
                offsets[row] = at
            row += 1
        at += len(line)
    return [offsets[row] for row in rows]


def _version_now(location: Location) -> str | None:
    location.fs.invalidate_cache(location.path)  # a listing this process made earlier may be out of date
    try:
        return object_version(location, location.fs.info(location.path))
    except FileNotFoundError:
        return None


def _changed(location: Location, version: str, now: str) -> InputError:
    return InputError("input_changed", f"the input object {location.uri} changed after the batch was planned "
                                       f"(size:version {version}, now {now}); the batch's chunks are ranges of "
                                       "the object as planned: send it again with `overwrite` (the CLI's "
                                       "--overwrite) to plan the object as it is now")


def _read_rows(location: Location, part: int, start: int, stop: int, options: Options) -> Pairs | list[bytes]:
    fmt, compression = format_of(location, options.format)
    fs = location.fs
    try:
        if fmt == "parquet":
            with fs.open(location.path, "rb") as f:
                parquet = pq.ParquetFile(f)
                present = [c for c in options.columns.names() if c in parquet.schema_arrow.names]
                table = parquet.read_row_group(part, columns=present)
            return _table_pairs(table.slice(start, stop - start), location, options)
        if compression:
            with fs.open(location.path, "rb", compression=compression) as f:
                begin, data = 0, f.read()
        else:
            begin, data = _byte_range(fs, location.path, start, stop)
        if fmt == "csv":
            if not data.endswith(b"\n"):
                data += b"\n"  # pyarrow finds no columns in a header-only file with no line break after it
            header = _first_line(fs, location.path, compression) if begin > 0 else data.split(b"\n", 1)[0]
            present = [c for c in options.columns.names() if c in _csv_header(header)]
            # A CSV's values are text: an id comes back as written (a guessed type would turn "007" into 7). (A CSV
            # cell holds no list: a label column's rows fail its check; it needs Parquet or JSONL.)
            convert = pacsv.ConvertOptions(include_columns=present, column_types={c: pa.string() for c in present})
            if begin > 0:
                _check_record_starts_at(fs, location.path, begin, header, convert)
            table = pacsv.read_csv(io.BytesIO(header + b"\n" + data if begin > 0 else data),
                                   convert_options=convert)
            return _table_pairs(table, location, options)
        if options.columns is not None:
            return _json_pairs(data.splitlines(), begin, location, options)
        return data.splitlines(keepends=True)  # with their ends: a worker cutting the chunk needs their offsets
    except FileNotFoundError:
        raise InputError("input_not_found", f"the input object {location.uri} does not exist") from None
    except Exception as exc:
        if not (_is_corrupt(exc) or isinstance(exc, KeyError)):
            raise  # the store's own failures (connection errors): the chunk is tried again
        # A CSV is planned in byte ranges cut at line breaks, which a quoted value with a line break in it defeats.
        hint = " (a CSV is read in parts cut at line breaks: a value holding a line break needs Parquet or JSONL)" \
            if fmt == "csv" and not compression else ""
        raise InputError("input_corrupt", f"{location.name} could not be read as {fmt}: {exc}{hint}") from None


def _check_record_starts_at(fs: Any, path: str, begin: int, header: bytes, convert: pacsv.ConvertOptions) -> None:
    """Raises InputError unless the last line before byte `begin` that is not blank reads as one whole record.
    A part of a CSV starts at a line break, which may lie inside a quoted value: the part would then read the
    value's last line as a record of its own (a real id beside text that is not the pair's). The line before
    such a part is a piece of that value, which mostly does not read as a record with the header's columns
    (its opening quote is not closed, or its columns are too few); a part after a whole record finds a whole
    record there. Not told apart: a value of three lines or more whose middle line happens to read as a record
    (a quote-aware scan from the file's start would be needed)."""
    window = READ_BLOCK_BYTES
    with fs.open(path, "rb", block_size=READ_BLOCK_BYTES) as f:
        while True:
            f.seek(max(begin - window, 0))
            before = f.read(begin - max(begin - window, 0)).rstrip(b"\r\n")  # pyarrow skips blank lines
            if b"\n" in before or window >= begin:
                break
            window *= 4
    line = before.rsplit(b"\n", 1)[-1] + b"\n"
    try:
        table = pacsv.read_csv(io.BytesIO(header + b"\n" + line), convert_options=convert)
    except pa.ArrowInvalid:
        table = None
    if table is None or table.num_rows != 1:
        raise InputError("input_corrupt", f"the line before byte {begin} is not a whole record, so a quoted value "
                                          "holds a line break (a CSV is read in parts cut at line breaks: a value "
                                          "holding a line break needs Parquet or JSONL)")


def _byte_range(fs: Any, path: str, start: int, stop: int) -> tuple[int, bytes]:
    """The lines that start in [start, stop), and the byte they start at: from the first line start at or
    after `start` to the end of the line holding byte stop - 1."""
    with fs.open(path, "rb", block_size=READ_BLOCK_BYTES) as f:
        if start > 0:
            f.seek(start - 1)
            f.readline()  # the rest of the line that started before `start` (or just its newline)
        begin = f.tell()
        if begin >= stop:
            return begin, b""
        data = f.read(stop - begin)
        if not data.endswith(b"\n"):
            data += f.readline()
        return begin, data


def _table_pairs(table: pa.Table, location: Location, options: Options) -> Pairs:
    """A Parquet or CSV table's rows; a named column the object lacks comes from its partition folders."""
    folders = partitions(location)
    columns: dict[str, list | pa.Array] = {}
    types: dict[str, pa.DataType] = {}
    spec = options.columns
    passed_only = set(spec.ids) - {spec.query, spec.item, spec.label}
    for name in spec.names():
        if name in table.column_names:
            # An id column stays an Arrow array: the chunk holds it until its results, and as Python values it
            # would be thousands of small objects held for nothing.
            column = table.column(name)
            columns[name] = column.combine_chunks() if name in passed_only else column.to_pylist()
            types[name] = table.schema.field(name).type
        elif name in folders:
            columns[name], types[name] = [folders[name]] * table.num_rows, pa.string()
        else:
            raise InputError("input_corrupt", f"{location.name} has no column {name!r}")
    return Pairs(columns, types, table.num_rows)


def _json_pairs(lines: list[bytes], begin: int, location: Location, options: Options) -> Pairs:
    """A JSONL pair table's rows (one object per line; blank lines are skipped). A line that is not an object,
    or lacks the query, item or label column, is a row with its error naming the line; an id column a line
    lacks is null there (as Spark and BigQuery leave out null fields)."""
    folders = partitions(location)
    spec = options.columns
    names = spec.names()
    required = {spec.query, spec.item} | ({spec.label} if spec.label else set())
    where = f"of {location.name}" if begin == 0 else f"from byte {begin} of {location.name}"
    columns: dict[str, list] = {name: [] for name in names}
    errors: dict[int, tuple[str, str]] = {}
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        row = len(columns[names[0]])
        obj: dict = {}
        try:
            value = _json_line(raw)
        except ValueError as exc:
            errors[row] = ("invalid_json", f"line {number} {where} is not JSON: {exc}")
        else:
            if isinstance(value, dict):
                obj = value
            else:
                errors[row] = ("invalid_row", f"line {number} {where} is not a JSON object")
        missing = [c for c in names if c in required and c not in obj and c not in folders]
        if row not in errors and missing:
            errors[row] = ("invalid_row", f"line {number} {where} has no {missing[0]!r}")
        for name in names:
            columns[name].append(obj.get(name, folders.get(name)))
    types = {}
    for name in spec.ids:
        columns[name], types[name] = _typed(columns[name])
    return Pairs(columns, types, len(columns[names[0]]), errors)


def _json_line(raw: bytes) -> Any:
    """A JSONL line's value; ValueError for one that is not JSON, nests deeper than the parser goes, or holds a
    lone surrogate (an escape, "\\ud800": no Arrow string or tokenizer takes it), so that it is the line's own
    error: raised past it, the chunk's rows would fail after its retries as if the store were down."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise ValueError("nested too deeply") from None
    if b"\\ud" in raw or b"\\uD" in raw:  # only an escape makes a surrogate: the other lines are not looked at
        check_storable(value)
    return value


def _typed(values: list) -> tuple[list, pa.DataType]:
    """An id column's values and their Arrow type; values of mixed types are kept as text (JSON for non-text)."""
    try:
        return values, pa.array(values).type
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return [v if v is None or isinstance(v, str) else json.dumps(v) for v in values], pa.string()


def _pairs(data: Pairs, options: Options, tokenizer: RequestTokenizer) -> ChunkRows:
    columns = options.columns
    rows = ChunkRows(True, data.n_rows, {name: data.columns[name] for name in columns.ids},
                     {name: data.types[name] for name in columns.ids}, errors=dict(data.errors))
    queries = data.columns[columns.query]
    items = data.columns[columns.item]
    labels = data.columns[columns.label] if columns.label else None
    groups: list[list[int]] = []

    def key(i: int) -> tuple:
        return (queries[i], tuple(labels[i]) if labels and labels[i] is not None else None)

    def group_rows(i: int) -> int:
        # A request of more items is refused (too_many_items), or of more items x labels (too_many_labels).
        n_labels = len(labels[i]) if labels is not None else len(options.label_token_ids or ())
        return max(1, min(MAX_GROUP_ROWS, tokenizer.max_items, tokenizer.max_scores // max(1, n_labels)))

    for i in range(data.n_rows):
        if i in rows.errors:
            continue
        if not isinstance(queries[i], (str, list)) or not isinstance(items[i], (str, list)):
            rows.errors[i] = ("invalid_row", f"{columns.query!r} and {columns.item!r} must be text or token ids "
                                             "(a value is missing)")
            continue
        if labels is not None and not isinstance(labels[i], list):
            rows.errors[i] = ("invalid_row", f"{columns.label!r} must be a list of token ids")
            continue
        if not groups or key(groups[-1][0]) != key(i) or len(groups[-1]) >= group_rows(i):
            groups.append([])
        groups[-1].append(i)
    label_ids = lambda group: labels[group[0]] if labels is not None else list(options.label_token_ids or [])
    tokenized = tokenizer.tokenize_many([(queries[g[0]], [items[i] for i in g], label_ids(g), options.item_first)
                                         for g in groups])
    for group, request in zip(groups, tokenized):
        _add_group(rows, group, queries, items, labels, options, tokenizer, request)
    return rows


def _add_group(rows: ChunkRows, group: list[int], queries: list, items: list, labels: list | None,
               options: Options, tokenizer: RequestTokenizer,
               tokenized: TokenizedRequest | ScoringError | None = None) -> None:
    """Adds a group's request (`tokenized`: the group tokenized already, or None); a group that fails as a whole
    for what one row may cause is split to find the row."""
    label_ids = labels[group[0]] if labels is not None else list(options.label_token_ids or [])
    try:
        if isinstance(tokenized, ScoringError):
            raise tokenized
        request = tokenized if tokenized is not None else tokenizer.tokenize(
            queries[group[0]], [items[i] for i in group], label_ids, options.item_first)
    except ScoringError as exc:
        if exc.code not in ("too_many_tokens", "mixed_input_types", "token_id_out_of_range", "invalid_input") \
                or len(group) == 1:
            for i in group:
                rows.errors[i] = (exc.code, exc.message)
            return
        # One row's item may be the cause: each row on its own says which; the others go on together.
        good = []
        for i in group:
            try:
                tokenizer.tokenize(queries[i], [items[i]], label_ids, options.item_first)
                good.append(i)
            except ScoringError as row_exc:
                rows.errors[i] = (row_exc.code, row_exc.message)
        if good and len(good) < len(group):
            _add_group(rows, good, queries, items, labels, options, tokenizer)
        elif good:  # each row alone is fine, together too many tokens: halve
            half = len(good) // 2
            _add_group(rows, good[:half], queries, items, labels, options, tokenizer)
            _add_group(rows, good[half:], queries, items, labels, options, tokenizer)
        return
    # Rows in a run as a range: a chunk holds its requests' rows for its life, an int object a row otherwise.
    contiguous = group[-1] - group[0] + 1 == len(group)
    rows.requests.append((range(group[0], group[-1] + 1) if contiguous else group, request, options.apply_softmax))


def _lines(lines: list[bytes], options: Options, tokenizer: RequestTokenizer) -> ChunkRows:
    kept = [line for line in lines if line.strip()]
    rows = ChunkRows(False, len(kept), {"custom_id": [None] * len(kept)}, {"custom_id": pa.string()})
    for i, raw in enumerate(kept):
        try:
            try:
                value = _json_line(raw)
            except ValueError as exc:
                raise LineError("invalid_json", f"not a JSON value: {exc}") from None
            if isinstance(value, dict) and isinstance(value.get("custom_id"), str):
                rows.passthrough["custom_id"][i] = value["custom_id"][:256]
            body, custom_id, return_logprobs = parse_line(value)
            if isinstance(body, RerankRequest):
                raise LineError("unknown_url", "rerank lines are served by uploaded batches, not reference batches")
            if body.model is not None and body.model != tokenizer.model_name:
                raise LineError("unknown_model", f"model {body.model!r}: this batch runs {tokenizer.model_name!r}")
            request = tokenizer.tokenize(body.query, body.items, body.label_token_ids, body.item_first)
        except LineError as exc:
            rows.errors[i] = (exc.code, exc.message)
            continue
        except ScoringError as exc:
            rows.errors[i] = (exc.code, exc.message)
            continue
        rows.return_logprobs[i] = return_logprobs or options.return_logprobs
        rows.requests.append(([i], request, body.apply_softmax))
    return rows


# ---- writing results ---------------------------------------------------------------------------------------


def result_table(rows: ChunkRows, logprobs: list[np.ndarray | None], options: Options,
                 failure: tuple[str, str] | None = None) -> pa.Table:
    """One row per input row: passthrough columns, scores (list<double> per pair; list<list<double>> per
    JSONL line), logprobs if asked for, error_code, error_message. `logprobs[k]`: request k's [items,
    labels] log-probabilities (None: not scored)."""
    n = rows.n_rows
    codes: list[str | None] = [None] * n
    messages: list[str | None] = [None] * n
    for i, (code, message) in rows.errors.items():
        codes[i], messages[i] = code, message
    for (covered, _, _), lp in zip(rows.requests, logprobs):
        if lp is None:
            for i in covered:
                codes[i], messages[i] = failure or ("internal_error", "the request was not scored")
    want_raw = options.return_logprobs or any(rows.return_logprobs.values())
    columns = {name: values if isinstance(values, pa.Array) else pa.array(values, rows.passthrough_types[name])
               for name, values in rows.passthrough.items()}
    if rows.pair_table:
        columns["scores"], raw = _pair_score_columns(rows, logprobs, want_raw)
    else:
        columns["scores"], raw = _line_score_columns(rows, logprobs)
    if want_raw:
        columns["logprobs"] = raw
    columns["error_code"] = pa.array(codes, pa.string())
    columns["error_message"] = pa.array(messages, pa.string())
    return pa.table(columns)


def _pair_score_columns(rows: ChunkRows, logprobs: list[np.ndarray | None],
                        want_raw: bool) -> tuple[pa.Array, pa.Array | None]:
    """A pair table's scores and log-probabilities, list<double> a row (null where not scored), built from whole
    arrays: a list of Python floats a row would be most of a commit's Python time and objects."""
    scored = [(np.asarray(covered, np.int64), lp, softmax)
              for (covered, _, softmax), lp in zip(rows.requests, logprobs) if lp is not None]
    lengths = np.zeros(rows.n_rows, np.int64)
    for covered, lp, _ in scored:
        lengths[covered] = lp.shape[1]  # a row is an item of its request: its labels' values
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    scores = np.empty(offsets[-1])
    raw = np.empty(offsets[-1]) if want_raw else None
    for covered, lp, softmax in scored:
        at = offsets[covered][:, None] + np.arange(lp.shape[1])
        scores[at] = scores_from_logprobs(lp, softmax)
        if raw is not None:
            raw[at] = lp
    null = pa.array(lengths == 0)  # not scored (a request has a label at least)
    column = lambda values: pa.ListArray.from_arrays(pa.array(offsets), pa.array(values), mask=null)
    return column(scores), column(raw) if raw is not None else None


def _line_score_columns(rows: ChunkRows, logprobs: list[np.ndarray | None]) -> tuple[pa.Array, pa.Array]:
    """A JSONL chunk's scores and log-probabilities, list<list<double>> a line (logprobs only where its line
    asked for them)."""
    scores: list[Any] = [None] * rows.n_rows
    raw: list[Any] = [None] * rows.n_rows
    for (covered, _, softmax), lp in zip(rows.requests, logprobs):
        if lp is not None:
            scores[covered[0]], raw[covered[0]] = score_lists(lp, softmax, bool(rows.return_logprobs.get(covered[0])))
    score_type = pa.list_(pa.list_(pa.float64()))
    return pa.array(scores, score_type), pa.array(raw, score_type)


def object_name(chunk_index: int, attempt: int, output_format: str) -> str:
    """A chunk attempt's object: a retried chunk never writes over (or next to, unnoticed) an earlier attempt."""
    return f"part-{chunk_index:06d}-attempt-{attempt}.{'parquet' if output_format == 'parquet' else 'jsonl'}"


def json_value(value: object) -> object:
    """An id column's value that JSON has no type for, as BigQuery's JSON exports write it: dates and times in
    ISO 8601, bytes in base64, decimals as their exact text (`json.dumps`' `default`: without it a date id fails
    every JSONL write of its chunk, retried as if the store were down)."""
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    return str(value)


def json_line(row: dict) -> str:
    """A result row as one JSON line. NaN and the infinities (a float id column's), for which JSON has no
    literal, are written null as pandas' JSON exports write them: `json.dumps` would write a bare `NaN`, which strict
    readers (Go's, Java's, `jq`) refuse, failing the whole file."""
    try:
        return json.dumps(row, separators=(",", ":"), default=json_value, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(row), separators=(",", ":"), default=json_value, allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_table(location: Location, table: pa.Table, output_format: str) -> None:
    with location.fs.open(location.path, "wb") as f:
        if output_format == "parquet":
            pq.write_table(table, f, compression="zstd")
        else:
            for batch in table.to_batches(max_chunksize=1000):
                f.write("".join(json_line(row) + "\n" for row in batch.to_pylist()).encode())


def read_table(location: Location) -> Iterator[list[dict]]:
    """A committed result object's rows, a thousand at a time."""
    with location.fs.open(location.path, "rb") as f:
        if location.path.endswith(".parquet"):
            for batch in pq.ParquetFile(f).iter_batches(batch_size=1000):
                yield batch.to_pylist()
        else:
            rows: list[dict] = []
            for line in f:
                rows.append(json.loads(line))
                if len(rows) >= 1000:
                    yield rows
                    rows = []
            if rows:
                yield rows


def write_manifest(prefix: Location, manifest: dict, success: bool) -> None:
    """`_manifest.json`, then `_SUCCESS` for a completed batch (readers that wait for _SUCCESS find the manifest
    complete)."""
    with prefix.fs.open(prefix.child("_manifest.json").path, "wb") as f:
        f.write(json.dumps(manifest, indent=1).encode())
    if success:
        with prefix.fs.open(prefix.child("_SUCCESS").path, "wb") as f:
            f.write(b"")
