"""What every service's command (``openbook-gateway``, ``openbook-retriever``,
``openbook-generator``) does before it serves, in this order: logging first, so that what
follows is logged as configured; the secrets, whose absence stops the start; Redis, whose
absence does not; tracing last but before the server exists, since its interceptors depend
on it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from openbook.config.settings import CommonSettings
from openbook.observability.logs import setup_logging
from openbook.observability.telemetry import setup_tracing

S = TypeVar("S", bound=CommonSettings)


def prepare(program: str, settings: CommonSettings) -> None:
    """Set up ``program``'s process from ``settings`` (module docstring): exit with a message
    naming the file when a configured secret cannot be read, warn (one line naming Redis, not
    a trace) when Redis cannot be reached."""
    setup_logging(settings.log_level)
    settings.check_secrets(program)
    settings.check_redis(program)
    setup_tracing(program)


def run(program: str, settings_class: Callable[[], S], serve: Callable[[S], None]) -> None:
    """A service's entry point: its settings read, the process prepared (:func:`prepare`:
    logging, secrets, Redis, tracing), then ``serve`` until it stops."""
    settings = settings_class()
    prepare(program, settings)
    serve(settings)
