"""Plain data types shared by every service."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Passage:
    """A passage of at most 100 words, optionally with its retriever score and stored vector."""

    id: str
    title: str
    text: str
    score: float = 0.0
    vector: np.ndarray | None = field(default=None, repr=False)
    # The page (from 1) of a paged document's passage (an uploaded PDF), 0 for any other: set
    # where a retrieval result crosses the wire (``common_pb2.Passage.page``).
    page: int = 0


# A live document's passages are "<doc_id>#<n>" (openbook.index.documents).
PASSAGE_ID_SEPARATOR = "#"


def document_id_of(passage_id: str) -> str:
    """The document a passage belongs to: ``<doc>#<n>`` -> ``<doc>``; an id without a
    numeric ``#`` suffix (a corpus's one-passage document) is its own document. Defined here,
    in the core, so that the gateway names a citation's document by the index's own rule."""
    head, sep, tail = passage_id.rpartition(PASSAGE_ID_SEPARATOR)
    if sep and head and tail.isdigit():
        return head
    return passage_id
