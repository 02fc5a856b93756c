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
