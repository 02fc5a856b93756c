"""Where a dense index's document vectors come from: a :class:`VectorSource`.

Write side. ``build_index`` and ``build_slice`` run the document encoder over the passages
(:func:`encoder_source`); ``import_embeddings`` reads precomputed files and a merge reads its
slices' vectors (their own sources). The stages (``stages.py``) only see the source.

Invariants: a source's ``digest`` changes whenever the vectors it would produce change (new
weights, another precision, other files), so that a resumed build never mixes shards of two;
``produce`` yields float32 ``(rows, dim)`` arrays for exactly the shards asked for, in order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from openbook.errors import InvalidArgument
from openbook.index.arrays import open_array
from openbook.index.encoders import Encoder, encoder_id, load_encoder, resolve_precision
from openbook.index.layout import PASSAGES_FILE, VECTORS_FILE
from openbook.index.manifest import MANIFEST, IndexLoadError, Manifest
from openbook.index.spec import BuildOptions, IndexSpec
from openbook.index.store import PassageStore


def encoding_device(device: str | None) -> torch.device:
    """``device`` (None: the CPU) as a torch device this machine has."""
    try:
        dev = torch.device(device or "cpu")
    except RuntimeError as exc:
        raise InvalidArgument(f"device {device!r}: {exc}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgument(f"device {device!r}: CUDA is not available on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise InvalidArgument(f"device {device!r}: expected cpu or cuda[:N]")
    return dev


def document_encoder(spec: IndexSpec, options: BuildOptions) -> tuple[Encoder, str, str]:
    """The spec's document encoder on the options' device, the query encoder's manifest name,
    and the resolved precision; the query encoder must have the document encoder's dim (and an
    ivfpq ``pq_m`` must divide it)."""
    encode_on = encoding_device(options.device)
    precision = resolve_precision(options.precision, encode_on)
    # A private copy when it moves: the shared one may serve queries on the CPU.
    doc_enc = load_encoder(spec.encoder, role="document", cached=encode_on.type == "cpu")
    doc_enc.to(encode_on)
    query_encoder = spec.query_encoder
    q_name = encoder_id(query_encoder) if query_encoder else doc_enc.name
    q_enc = load_encoder(query_encoder, role="query") if query_encoder else doc_enc
    if q_enc.dim != doc_enc.dim:
        raise InvalidArgument(
            f"query encoder {q_enc.name!r} dim {q_enc.dim} != document encoder "
            f"{doc_enc.name!r} dim {doc_enc.dim}"
        )
    pq_m = spec.ann.pq_m
    if spec.index_type == "ivfpq" and pq_m is not None and doc_enc.dim % pq_m:
        raise InvalidArgument(f"pq_m={pq_m} must divide the encoder dim {doc_enc.dim}")
    return doc_enc, q_name, precision


# The similarity scale that sentence-transformers' MultipleNegativesRankingLoss trains with
# (all-MiniLM-L6-v2 included): softmax(20 x cosine) is the distribution such an encoder learned.
COSINE_SCORE_SCALE = 20.0


def default_score_scale(doc_encoder: Encoder | None) -> float:
    """How much to multiply inner products by so that softmax over them is a useful prior.

    DPR (RAG's retriever) scores with raw inner products that lie tens of units apart, so the
    prior softmax(d·q) is peaked as is: scale 1. Encoders that normalise their vectors score
    with cosine similarities in [-1, 1], whose softmax over the top k is nearly uniform — with
    MiniLM that let wrong passages outvote the right one in RAG-Token (docs/results.md) — so
    they get the scale they were trained with. BM25 scores are left as they are.
    """
    if doc_encoder is not None and doc_encoder.normalize:
        return COSINE_SCORE_SCALE
    return 1.0


def weights_digest(enc: Encoder) -> str:
    """Cheap digest of the weights so shards from a since-retrained encoder are not reused."""
    h = hashlib.sha256()
    for k, v in sorted(enc.model.state_dict().items()):
        flat = v.detach().reshape(-1)
        h.update(k.encode())
        h.update(flat[:64].float().cpu().numpy().tobytes())
        h.update(str(float(flat.float().sum())).encode())
    return h.hexdigest()


@dataclass(frozen=True)
class ShardWork:
    """What a :data:`ShardProducer` is asked for: the shards ``todo`` (ascending) of the
    passages in ``store``, every shard's ``[start, stop)`` rows in ``spans``, and ``update``,
    called with the rows done as they are done (progress)."""

    store: PassageStore
    spans: list[tuple[int, int]]
    todo: list[int]
    update: Callable[[int], None]


# Yields (shard number, its float32 (rows, dim) vectors) for each shard of the work's ``todo``.
ShardProducer = Callable[[ShardWork], Iterator[tuple[int, np.ndarray]]]


@dataclass(frozen=True)
class VectorSource:
    """Where a dense index's document vectors come from: an encoder run over the passages
    (``build_index``) or precomputed embedding files (``import_embeddings``)."""

    encoder: str  # the manifest's document encoder
    query_encoder: str  # the manifest's query encoder: what the retriever loads
    dim: int
    normalize: bool
    digest: Callable[[], str]  # what the vectors are computed from (resume fingerprint)
    produce: ShardProducer
    desc: str = "embedding"
    inputs: tuple[Path, ...] = ()  # files the vectors are read from, if any

    @classmethod
    def like(
        cls,
        manifest: Manifest,
        digest: Callable[[], str],
        produce: ShardProducer,
        desc: str,
        inputs: tuple[Path, ...] = (),
    ) -> VectorSource:
        """Vectors that an existing dense index (``manifest``) already holds, read again to
        build another one over them (a compaction, a merge): the new index takes the encoders,
        dim and normalisation of ``manifest``, so it answers queries as the old one did."""
        return cls(
            encoder=manifest.encoder or "",
            query_encoder=manifest.query_encoder or manifest.encoder or "",
            dim=manifest.dim,
            normalize=manifest.normalize,
            digest=digest,
            produce=produce,
            desc=desc,
            inputs=inputs,
        )


class VectorDonors:
    """Vectors already computed by this encoder for identical passages, in other dense indexes
    (``BuildOptions.reuse_vectors_from``): a build encodes only the passages they lack.

    A donor gives its vectors only where they are what the encoder computes now: same document
    encoder, normalisation and dimension in its manifest, and a sample of its passages
    re-encoded here within float tolerance of its stored vectors (a retrained encoder saved
    at the same path gives nothing). Keys are the exact (title, text) the encoder reads.
    """

    SAMPLE = 8  # passages re-encoded per donor to check its vectors
    TOLERANCE = 1e-4  # max abs difference of a re-encoded sample (float32 batches differ ~1e-6)

    def __init__(self) -> None:
        self._rows: dict[tuple[str, str], tuple[int, int]] = {}  # key -> (donor, row)
        self._vectors: list[np.ndarray] = []

    @classmethod
    def open(
        cls, paths: Sequence[Path], enc: Encoder, batch_size: int, precision: str
    ) -> VectorDonors:
        donors = cls()
        for path in paths:
            donors._add(Path(path), enc, batch_size, precision)
        return donors

    def _add(self, path: Path, enc: Encoder, batch_size: int, precision: str) -> None:
        try:
            manifest = Manifest.from_file(path / MANIFEST)
        except (IndexLoadError, OSError):
            return  # not (yet) an index: nothing to reuse
        if (manifest.encoder, manifest.dim, manifest.normalize) != (
            enc.name,
            enc.dim,
            bool(enc.normalize),
        ) or not (path / VECTORS_FILE).is_file():
            return
        vectors = open_array(path / VECTORS_FILE)
        store = PassageStore(path / PASSAGES_FILE)
        try:
            keys = [tuple(r) for batch in store.iter_batches(0, len(store)) for r in batch]
        finally:
            store.close()
        if len(keys) != vectors.shape[0] or not keys:
            return
        step = max(1, len(keys) // self.SAMPLE)
        sample = list(range(0, len(keys), step))[: self.SAMPLE]
        again = enc.encode(
            [keys[r][1] for r in sample],
            batch_size,
            titles=[keys[r][0] for r in sample],
            precision=precision,
        )
        if not np.allclose(again, vectors[sample], rtol=0, atol=self.TOLERANCE):
            return
        donor = len(self._vectors)
        self._vectors.append(vectors)
        for row, key in enumerate(keys):
            self._rows.setdefault((key[0], key[1]), (donor, row))

    def __len__(self) -> int:
        return len(self._rows)

    def lookup(self, keys: Sequence[tuple[str, str]]) -> dict[int, np.ndarray]:
        """Index in ``keys`` -> its donated float32 vector, for the keys a donor holds."""
        out: dict[int, np.ndarray] = {}
        for i, key in enumerate(keys):
            hit = self._rows.get(key)
            if hit is not None:
                out[i] = np.asarray(self._vectors[hit[0]][hit[1]], dtype=np.float32)
        return out


def encoder_source(
    enc: Encoder,
    q_name: str | None,
    batch_size: int,
    precision: str = "float32",
    donors: VectorDonors | None = None,
) -> VectorSource:
    """Vectors from ``enc`` run over the passages in ``precision`` (a resolved name); those of
    passages ``donors`` hold are taken from them instead."""

    def produce(work: ShardWork) -> Iterator[tuple[int, np.ndarray]]:
        update = work.update
        for i in work.todo:
            a, b = work.spans[i]
            rows = [row for batch in work.store.iter_batches(a, b) for row in batch]
            donated = donors.lookup([(r[0], r[1]) for r in rows]) if donors else {}
            if donated:
                update(len(donated))
            todo_rows = [j for j in range(len(rows)) if j not in donated]
            # One call per embedding shard: the encoder sorts by length across the whole shard
            # (fuller batches than a smaller window) and tokenizes ahead of the model.
            encoded = enc.encode(
                [rows[j][1] for j in todo_rows],
                batch_size,
                titles=[rows[j][0] for j in todo_rows],
                precision=precision,
                on_progress=update,
            )
            if not donated:
                yield i, encoded
                continue
            vecs = np.empty((len(rows), enc.dim), dtype=np.float32)
            vecs[todo_rows] = encoded
            for j, vec in donated.items():
                vecs[j] = vec
            yield i, vecs

    def digest() -> str:
        # float32 keeps the digest builds had before precisions existed (their partial builds
        # stay resumable); shards encoded in another precision are never mixed with them.
        weights = weights_digest(enc)
        return weights if precision == "float32" else f"{weights}+{precision}"

    return VectorSource(
        encoder=enc.name,
        query_encoder=q_name or enc.name,
        dim=enc.dim,
        normalize=bool(enc.normalize),
        digest=digest,
        produce=produce,
    )
