"""Exceptions raised by the RAG generation library.

A caller's mistake (a malformed request, bad decoding options) is
:class:`openbook.errors.InvalidArgument`, the one error type for it everywhere."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model directory is missing files or holds corrupt ones; the message names the file."""


class Abandoned(RuntimeError):
    """Every caller of a decoding group gave up (deadline passed, cancelled): work stopped."""
