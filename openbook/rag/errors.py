"""Exceptions raised by the RAG generation library."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A generation request is malformed; the message names the offending field."""


class ModelLoadError(ValueError):
    """A model directory is missing files or holds corrupt ones; the message names the file."""


class Abandoned(RuntimeError):
    """Every caller of a decoding group gave up (deadline passed, cancelled): work stopped."""
