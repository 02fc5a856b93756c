"""How an ``openbook docs`` or ``openbook keys`` command reaches the gateway, written once.

:class:`GatewayOptions` adds ``--url``, ``--admin-token``, ``--timeout`` (and, where it is
offered, ``--key``) to a command and hands it the :class:`~openbook_cli.docs.GatewayTarget`
they make, as its ``target`` parameter; :func:`reply` prints the gateway's JSON reply or exits 1
with its refusal on stderr.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import typer

from openbook_cli.docs import DocsError, GatewayTarget


@dataclass(frozen=True)
class GatewayOptions:
    """The connection options of a group of commands: its default seconds per HTTP call, what
    its ``--admin-token`` is for, and whether a key (``--key``) may stand in for it."""

    timeout_s: float
    token_help: str
    with_key: bool = False

    def _options(self) -> list[inspect.Parameter]:
        def option(name: str, annotation: Any, default: Any) -> inspect.Parameter:
            return inspect.Parameter(
                name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation
            )

        url = typer.Option(
            "http://127.0.0.1:8000", "--url", envvar="OPENBOOK_URL", help="gateway URL"
        )
        token = typer.Option(
            None,
            "--admin-token",
            envvar="OPENBOOK_ADMIN_TOKEN",
            help=self.token_help,
            show_default=False,
        )
        key = typer.Option(
            None,
            "--key",
            envvar="OPENBOOK_API_KEY",
            help="a key of the gateway (openbook keys create): sent instead of the admin token",
            show_default=False,
        )
        timeout = typer.Option(self.timeout_s, "--timeout", help="seconds per HTTP call")
        options = [option("url", str, url), option("admin_token", str | None, token)]
        if self.with_key:
            options.append(option("key", str | None, key))
        return [*options, option("timeout_s", float, timeout)]

    def __call__(self, command: Callable[..., None]) -> Callable[..., None]:
        """``command`` with the connection options in place of its ``target`` parameter: the key
        if one is given (what it may do is what its scopes, indexes and tenant allow), else the
        admin token."""
        signature = inspect.signature(command, eval_str=True)
        own = [p for p in signature.parameters.values() if p.name != "target"]

        @functools.wraps(command)
        def run(
            *args: Any,
            url: str,
            admin_token: str | None,
            timeout_s: float,
            key: str | None = None,
            **kwargs: Any,
        ) -> None:
            command(*args, target=GatewayTarget(url, key or admin_token, timeout_s), **kwargs)

        parameters = [*own, *self._options()]
        run.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
        run.__annotations__ = {p.name: p.annotation for p in parameters} | {"return": None}
        return run


def reply(group: str, command: str, call: Callable[[], Any]) -> None:
    """Print ``call()``'s JSON reply; a refusal exits 1 with ``openbook GROUP COMMAND: why``."""
    try:
        result = call()
    except DocsError as exc:
        raise fail(group, command, exc) from None
    echo_json(result)


def echo_json(result: Any) -> None:
    typer.echo(json.dumps(result, indent=2, ensure_ascii=False))


def fail(group: str, command: str, exc: Exception) -> typer.Exit:
    typer.echo(f"openbook {group} {command}: {exc}", err=True)
    return typer.Exit(1)
