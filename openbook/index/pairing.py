"""Which query encoder searches which index.

Read side.

Every dense index's manifest names its document ``encoder`` and its ``query_encoder``: the
pair it was built for. A query-encoder *override* (``OPENBOOK_RETRIEVER_QUERY_ENCODER``, or the
fine-tuned query encoder of a trained checkpoint) replaces the manifest's query encoder only
on the indexes it pairs with:

* the dimensions are equal, and
* the override is of the index's *lineage*: the manifest's ``encoder`` or ``query_encoder``
  is one of the override's lineage names, or the override is a DPR question encoder (a RAG
  directory's included) and the index's document encoder is a DPR context encoder.

An override's lineage is its own encoder id plus the ``source`` recorded in its
``openbook_encoder.json`` (what a fine-tuned save started from) or, for a LoRA adapter, the
base encoder its ``openbook_adapter.json`` names; a checkpoint's adds its
``base_query_encoder`` and the document and query encoders of the index it was trained against.
Every other index keeps its own manifest's query encoder: a query is never encoded by an
encoder of another lineage or dimension.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable
from pathlib import Path

from openbook.index.encoders import _ALIASES, DEFAULT_ENCODER, ENCODER_CONFIG, Encoder
from openbook.index.manifest import Manifest
from openbook.rag.adapters import ADAPTER_FILE
from openbook.storage.artifacts import public_name


def _norm(name: str | None) -> str | None:
    """Encoder names compared as manifests record them: the MiniLM alias, else a path."""
    if not name:
        return None
    if name in _ALIASES:
        return DEFAULT_ENCODER
    return os.path.normpath(os.path.expanduser(name)) if os.path.isabs(name) else name


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def saved_source(encoder: Encoder) -> str | None:
    """The encoder a directory written by ``Encoder.save`` was saved from, or a LoRA adapter
    directory's base encoder (its lineage)."""
    path = Path(encoder.name)
    return (
        _json(path / ENCODER_CONFIG).get("source")
        or _json(path / ADAPTER_FILE).get("base_model")
        or None
    )


def is_dpr_context_encoder(name: str | None) -> bool:
    """Whether a manifest's document encoder is a DPR context encoder: from its directory's
    config when it is here, else from its name (``facebook/dpr-ctx_encoder-...``)."""
    if not name:
        return False
    path = Path(name).expanduser()
    if path.is_dir():
        own = _json(path / ENCODER_CONFIG)
        if own:
            return own.get("kind") == "dpr-context"
        cfg = _json(path / "config.json")
        return cfg.get("model_type") == "dpr" and "DPRContextEncoder" in (
            cfg.get("architectures") or []
        )
    lowered = name.lower()
    return "ctx_encoder" in lowered or "dpr-ctx" in lowered


class QueryEncoderOverride:
    """A query encoder that replaces the manifests' own on the indexes it pairs with."""

    def __init__(
        self, encoder: Encoder, origin: str, lineage: Iterable[str | None], version: str
    ) -> None:
        self.encoder = encoder
        self.origin = origin  # where it comes from, for messages
        self.version = version  # the model_version replies name when it searched
        self.lineage = frozenset(
            n for n in (_norm(x) for x in (encoder.name, saved_source(encoder), *lineage)) if n
        )
        self.dpr_question = encoder.kind == "dpr-question"
        self._fits: dict[tuple[str, str, str | None, str | None, int], str | None] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"QueryEncoderOverride({self.encoder.name!r}, {self.origin}, dim={self.encoder.dim})"

    def problem(self, manifest: Manifest, name: str | None = None) -> str | None:
        """Why this override may not search ``manifest``'s index (None: it pairs with it)."""
        key = (
            name or manifest.name,
            manifest.checksum,
            manifest.encoder,
            manifest.query_encoder,
            manifest.dim,
        )
        with self._lock:
            if key in self._fits:
                return self._fits[key]
        answer = self._problem(manifest, name or manifest.name)
        with self._lock:
            self._fits[key] = answer
        return answer

    def fits(self, manifest: Manifest, name: str | None = None) -> bool:
        return manifest.dense and self.problem(manifest, name) is None

    def _problem(self, m: Manifest, name: str) -> str | None:
        if not m.dense:
            return f"index {name!r} is bm25 and takes no query encoder"
        enc = self.encoder
        what = (
            f"query encoder {enc.name!r} ({self.origin}, dim {enc.dim}) does not pair with "
            f"index {name!r} (document encoder {m.encoder!r}, query encoder "
            f"{m.query_encoder!r}, dim {m.dim})"
        )
        if enc.dim != m.dim:
            return f"{what}: dim {enc.dim} != index dim {m.dim}"
        if {_norm(m.encoder), _norm(m.query_encoder)} & self.lineage:
            return None
        if self.dpr_question and is_dpr_context_encoder(m.encoder):
            return None
        return f"{what}: another encoder lineage (it pairs with {', '.join(sorted(self.lineage))})"


def configured_override(encoder: Encoder, name: str | None = None) -> QueryEncoderOverride:
    """``OPENBOOK_RETRIEVER_QUERY_ENCODER``: pairs with indexes whose manifest names it (or what
    it was saved from) as query or document encoder, and, for a DPR question encoder or a RAG
    directory, with DPR context-encoder indexes; always of its dimension."""
    return QueryEncoderOverride(
        encoder, "OPENBOOK_RETRIEVER_QUERY_ENCODER", [name], public_name(encoder.name)
    )


def checkpoint_override(
    encoder: Encoder,
    version: str,
    base_query_encoder: str | None,
    trained_on: Manifest | None,
) -> QueryEncoderOverride:
    """A trained checkpoint's query encoder: pairs with the index it was trained against and
    every index of the same lineage (built with the same document or query encoder, or named
    after its base query encoder), of its dimension."""
    lineage = [base_query_encoder]
    if trained_on is not None:
        lineage += [trained_on.encoder, trained_on.query_encoder]
    return QueryEncoderOverride(encoder, f"checkpoint {version}", lineage, version)
