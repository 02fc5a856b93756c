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
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from openbook.index.encoders import Encoder, encoder_id, load_encoder, resolve_precision
from openbook.index.manifest import Manifest
from openbook.index.spec import BuildOptions, IndexSpec
from openbook.index.store import PassageStore


def encoding_device(device: str | None) -> torch.device:
    """``device`` (None: the CPU) as a torch device this machine has."""
    try:
        dev = torch.device(device or "cpu")
    except RuntimeError as exc:
        raise ValueError(f"device {device!r}: {exc}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: CUDA is not available on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r}: expected cpu or cuda[:N]")
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
        raise ValueError(
            f"query encoder {q_enc.name!r} dim {q_enc.dim} != document encoder "
            f"{doc_enc.name!r} dim {doc_enc.dim}"
        )
    pq_m = spec.ann.pq_m
    if spec.index_type == "ivfpq" and pq_m is not None and doc_enc.dim % pq_m:
        raise ValueError(f"pq_m={pq_m} must divide the encoder dim {doc_enc.dim}")
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


# Yields (shard number, its float32 (rows, dim) vectors) for the shards in ``todo`` (ascending),
# given the passage store, every shard's [start, stop) rows, and a progress callback (rows).
ShardProducer = Callable[
    [PassageStore, list[tuple[int, int]], list[int], Callable[[int], None]],
    Iterator[tuple[int, np.ndarray]],
]


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


def encoder_source(
    enc: Encoder, q_name: str | None, batch_size: int, precision: str = "float32"
) -> VectorSource:
    """Vectors from ``enc`` run over the passages in ``precision`` (a resolved name)."""

    def produce(
        store: PassageStore,
        spans: list[tuple[int, int]],
        todo: list[int],
        update: Callable[[int], None],
    ) -> Iterator[tuple[int, np.ndarray]]:
        for i in todo:
            a, b = spans[i]
            rows = [row for batch in store.iter_batches(a, b) for row in batch]
            # One call per embedding shard: the encoder sorts by length across the whole shard
            # (fuller batches than a smaller window) and tokenizes ahead of the model.
            vecs = enc.encode(
                [r[1] for r in rows],
                batch_size,
                titles=[r[0] for r in rows],
                precision=precision,
                on_progress=update,
            )
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
