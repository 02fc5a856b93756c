"""What the generator service's tests send it: a ``GenerateRequest`` of given passages."""

from __future__ import annotations

from collections.abc import Sequence

from openbook.types import Passage
from openbook.v1 import common_pb2, generator_pb2
from openbook_testkit.rag import QUESTION


def generate_request(
    passages: Sequence[Passage], question: str = QUESTION, **options
) -> generator_pb2.GenerateRequest:
    """``question`` over ``passages``, decoded with ``options`` (``DecodingOptions`` fields)."""
    return generator_pb2.GenerateRequest(
        question=question,
        passages=[
            common_pb2.Passage(id=p.id, title=p.title, text=p.text, score=p.score) for p in passages
        ],
        options=generator_pb2.DecodingOptions(**options),
    )
