"""Reading precomputed passage embeddings in the formats they are published in, batch by batch.

Write side.

* ``pickle``: DPR's ``generate_dense_embeddings`` shards (``wikipedia_passages_<n>.pkl``), each a
  pickled list of ``(id, vector)`` tuples; ``vector`` a 1-d numpy float array.
* ``parquet`` / ``arrow``: Hugging Face ``wiki_dpr``-style tables with an ``id`` column and an
  ``embeddings`` column (list<float32>), read with pyarrow one record batch at a time. ``arrow``
  is the IPC stream format of ``datasets``' cache files (the IPC file format is read as well).

Memory: parquet/arrow hold one record batch at a time. A pickle cannot be read partially, so a
pickle shard is loaded whole (DPR's 50 shards of 420k x 768 are ~1.3 GB each) and then handed
out in batches; either way the peak does not grow with the number of files. Pickles are loaded
with an unpickler that only builds numpy arrays, so a tampered file cannot run code.

Every problem is an :class:`EmbeddingsError` naming the file (and entry) at fault.
"""

from __future__ import annotations

import pickle
import re
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from openbook.errors import InvalidArgument
from openbook.types import Passage

if TYPE_CHECKING:
    import pyarrow as pa

EMBEDDING_FORMATS = ("auto", "pickle", "parquet", "arrow")
ID_COLUMN = "id"
VECTOR_COLUMN = "embeddings"
PASSAGE_COLUMNS = (ID_COLUMN, "title", "text")


class EmbeddingsError(ValueError):
    """Embedding files that are unreadable or disagree with the passages they belong to."""


@dataclass(frozen=True)
class EmbeddingBatch:
    """Consecutive entries ``first .. first + len(ids) - 1`` (0-based) of file ``path``."""

    path: Path
    first: int
    ids: list[str]
    vectors: np.ndarray  # float32 (len(ids), dim)


def detect_embedding_format(path: Path) -> str:
    name = path.name.lower()
    if name.endswith((".pkl", ".pickle")):
        return "pickle"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(".arrow"):
        return "arrow"
    raise EmbeddingsError(
        f"{path}: cannot guess the embeddings format from the extension; "
        f"pass one of {', '.join(EMBEDDING_FORMATS[1:])}"
    )


def natural_order(paths: Iterable[Path]) -> list[Path]:
    """Sort so that ``..._2.pkl`` comes before ``..._10.pkl`` (a shell glob sorts them the
    other way round, and DPR's shards must be read in the passages file's order)."""

    def key(p: Path) -> list:
        return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(p))]

    return sorted((Path(p) for p in paths), key=key)


def iter_embeddings(
    paths: Iterable[Path], fmt: str = "auto", batch_size: int = 10_000
) -> Generator[EmbeddingBatch, None, None]:
    """Yield the entries of every file in ``paths``, in order, as batches of at most
    ``batch_size``. Within a file all vectors have one dimension (checked across files by the
    importer); ids are strings as written (``"1"`` or ``"wiki:1"``)."""
    if fmt not in EMBEDDING_FORMATS:
        raise EmbeddingsError(f"unknown embeddings format {fmt!r}; expected {EMBEDDING_FORMATS}")
    if batch_size < 1:
        raise InvalidArgument(f"batch_size must be >= 1, got {batch_size}")
    for raw in paths:
        path = Path(raw)
        if not path.is_file():
            raise EmbeddingsError(f"{path}: no such file")
        kind = detect_embedding_format(path) if fmt == "auto" else fmt
        if kind == "pickle":
            yield from _read_pickle(path, batch_size)
        else:
            yield from _read_table(path, kind, batch_size)


# What numpy arrays (and their dtypes / scalars) pickle to, across numpy 1.x and 2.x.
_NUMPY_GLOBALS = {
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "scalar"),
}


class _NumpyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _NUMPY_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def _read_pickle(path: Path, batch_size: int) -> Iterator[EmbeddingBatch]:
    try:
        with open(path, "rb") as f:
            data = _NumpyUnpickler(f).load()
    except EOFError:
        raise EmbeddingsError(f"{path}: truncated pickle (ends before its end mark)") from None
    except (pickle.UnpicklingError, ValueError, TypeError, AttributeError, IndexError) as e:
        if "truncated" in str(e):
            raise EmbeddingsError(f"{path}: truncated pickle ({e})") from None
        raise EmbeddingsError(f"{path}: not a readable embeddings pickle ({e})") from None
    if not isinstance(data, list | tuple):
        raise EmbeddingsError(
            f"{path}: expected a pickled list of (id, vector) tuples, got {type(data).__name__}"
        )
    dim = None
    for first in range(0, len(data), batch_size):
        chunk = data[first : first + batch_size]
        ids: list[str] = []
        vecs = []
        for j, entry in enumerate(chunk, first):
            if not (isinstance(entry, tuple | list) and len(entry) == 2):
                raise EmbeddingsError(f"{path}: entry {j} is not an (id, vector) pair")
            pid, vec = entry
            if not isinstance(pid, str | int) or isinstance(pid, bool):
                raise EmbeddingsError(f"{path}: entry {j}: id {pid!r} is not a string")
            if not isinstance(vec, np.ndarray) or vec.dtype.kind != "f" or vec.ndim != 1:
                raise EmbeddingsError(f"{path}: entry {j} (id {pid!r}): not a 1-d float array")
            if dim is None:
                dim = vec.shape[0]
            elif vec.shape[0] != dim:
                raise EmbeddingsError(
                    f"{path}: entry {j} (id {pid!r}) has dim {vec.shape[0]}, expected {dim}"
                )
            ids.append(str(pid))
            vecs.append(vec)
        yield EmbeddingBatch(path, first, ids, np.stack(vecs).astype(np.float32, copy=False))
        if isinstance(data, list):  # free what was handed out as we go
            data[first : first + batch_size] = [None] * len(chunk)


def iter_table_passages(
    paths: Iterable[Path], fmt: str = "auto", batch_size: int = 10_000
) -> Iterator[Passage]:
    """The passages (``id``, ``title``, ``text`` columns) of wiki_dpr-style parquet/arrow files,
    in order: such files carry their own text, so they need no psgs_w100.tsv."""
    import pyarrow as pa

    for raw in paths:
        path = Path(raw)
        kind = detect_embedding_format(path) if fmt == "auto" else fmt
        if kind == "pickle":
            raise EmbeddingsError(
                f"{path}: DPR's pickles hold no passage text; pass the passages file "
                "(psgs_w100.tsv) as well"
            )
        try:
            for rb in _table_batches(path, kind, batch_size, PASSAGE_COLUMNS):
                cols = [rb.column(c).to_pylist() for c in PASSAGE_COLUMNS]
                for pid, title, text in zip(*cols, strict=True):
                    if pid is None or title is None or text is None:
                        raise EmbeddingsError(f"{path}: null id, title or text (id {pid!r})")
                    yield Passage(id=str(pid), title=str(title), text=str(text))
        except (pa.ArrowException, OSError) as e:
            raise EmbeddingsError(f"{path}: not a readable {kind} file ({e})") from None


def _read_table(path: Path, kind: str, batch_size: int) -> Iterator[EmbeddingBatch]:
    import pyarrow as pa

    try:
        batches = _table_batches(path, kind, batch_size, (ID_COLUMN, VECTOR_COLUMN))
        first = 0
        dim = None
        for rb in batches:
            ids, vecs = _batch_arrays(path, rb, first)
            if dim is None:
                dim = vecs.shape[1]
            elif vecs.shape[1] != dim:
                raise EmbeddingsError(
                    f"{path}: rows from {first} have dim {vecs.shape[1]}, expected {dim}"
                )
            for s in range(0, len(ids), batch_size):
                yield EmbeddingBatch(
                    path, first + s, ids[s : s + batch_size], vecs[s : s + batch_size]
                )
            first += len(ids)
    except (pa.ArrowException, OSError) as e:
        raise EmbeddingsError(f"{path}: not a readable {kind} file ({e})") from None


def _table_batches(path: Path, kind: str, batch_size: int, columns: tuple[str, ...]) -> Iterator:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if kind == "parquet":
        pf = pq.ParquetFile(path)
        _check_columns(path, pf.schema_arrow.names, columns)
        yield from pf.iter_batches(batch_size=batch_size, columns=list(columns))
        return
    source = pa.memory_map(str(path))
    try:
        reader = pa.ipc.open_stream(source)
    except pa.ArrowInvalid:
        reader = pa.ipc.open_file(source)
    _check_columns(path, reader.schema.names, columns)
    if isinstance(reader, pa.ipc.RecordBatchFileReader):
        batches: Iterable = (reader.get_batch(i) for i in range(reader.num_record_batches))
    else:
        batches = reader
    for rb in batches:
        # datasets' cache files may hold large batches: hand them out batch_size rows at a time
        for s in range(0, rb.num_rows, batch_size):
            yield rb.slice(s, batch_size).select(list(columns))


def _check_columns(path: Path, names: list[str], columns: tuple[str, ...]) -> None:
    for col in columns:
        if col not in names:
            raise EmbeddingsError(
                f"{path}: no {col!r} column (columns: {', '.join(names) or 'none'})"
            )


def _batch_arrays(path: Path, rb: pa.RecordBatch, first: int) -> tuple[list[str], np.ndarray]:
    import pyarrow as pa
    import pyarrow.compute as pc

    col = rb.column(VECTOR_COLUMN)
    n = len(col)
    if not (
        pa.types.is_list(col.type)
        or pa.types.is_large_list(col.type)
        or pa.types.is_fixed_size_list(col.type)
    ):
        raise EmbeddingsError(
            f"{path}: column {VECTOR_COLUMN!r} is {col.type}, not a list of floats"
        )
    if not pa.types.is_floating(col.type.value_type):
        raise EmbeddingsError(
            f"{path}: column {VECTOR_COLUMN!r} is {col.type}, not a list of floats"
        )
    if col.null_count or rb.column(ID_COLUMN).null_count:
        raise EmbeddingsError(f"{path}: null id or embedding in rows {first}..{first + n - 1}")
    lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
    if n and (lengths != lengths[0]).any():
        j = int(np.argmax(lengths != lengths[0]))
        raise EmbeddingsError(
            f"{path}: row {first + j} has dim {lengths[j]}, expected {lengths[0]}"
        )
    dim = int(lengths[0]) if n else 0
    values = pc.list_flatten(col).to_numpy(zero_copy_only=False)
    vecs = np.asarray(values, dtype=np.float32).reshape(n, dim)
    ids = [str(x) for x in rb.column(ID_COLUMN).to_pylist()]
    return ids, vecs
