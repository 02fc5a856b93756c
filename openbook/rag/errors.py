"""Exceptions raised by the RAG generation library.

A caller's mistake (a malformed request, bad decoding options, a setting out of range) is
:class:`openbook.errors.InvalidArgument`, the one error type for it everywhere; a model that
cannot be served is a :class:`ModelLoadError`; a broken invariant of the library's own code (a
decoding state joined or kept against its contract) is :class:`openbook.errors.InternalError`.
``tests/test_error_vocabulary.py`` checks that no module of ``openbook/`` raises a bare
``ValueError``."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model that cannot be served: its directory is missing files or holds corrupt ones (a
    weights, prompt or confidence calibration file, an adapter for another base), its config
    is of a kind this code cannot decode, or it cannot take the form it is asked to serve in (an
    int8 LM head). The message names the file or what is refused.

    A ``ValueError`` (every ``except ValueError`` of a loader's caller holds), declared a
    client error where a request names the model (the generator's ReloadModel:
    INVALID_ARGUMENT, the gateway's 422)."""


class Abandoned(RuntimeError):
    """Every caller of a decoding group gave up (deadline passed, cancelled): work stopped."""
