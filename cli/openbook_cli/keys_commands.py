"""``openbook keys``: make, list and delete keys with scopes (issue 43), over the gateway's
``/admin/keys`` with the admin token (``OPENBOOK_ADMIN_TOKEN``), as ``openbook docs`` talks to
it (:mod:`openbook_cli.docs`).

``create`` prints the key's secret, which the gateway shows this once; ``ls`` the keys (never a
secret); ``rm`` revokes one at every gateway from the next request on. A refusal exits 1 with
the gateway's status and detail on stderr.
"""

from __future__ import annotations

import json
from typing import Any

import typer

from openbook_cli.docs import DocsError, GatewayTarget, call

keys_app = typer.Typer(
    help="Keys with scopes (ask, write, indexes:create, admin), optionally held to indexes, a "
    "tenant's filter and a rate: create, ls, rm "
    "(the gateway's /admin/keys; needs OPENBOOK_ADMIN_TOKEN).",
    no_args_is_help=True,
)

URL = typer.Option("http://127.0.0.1:8000", "--url", envvar="OPENBOOK_URL", help="gateway URL")
TOKEN = typer.Option(
    None,
    "--admin-token",
    envvar="OPENBOOK_ADMIN_TOKEN",
    help="the admin token (or a key with the admin scope)",
    show_default=False,
)
TIMEOUT = typer.Option(30.0, "--timeout", help="seconds per HTTP call")


def _done(reply: Any) -> None:
    typer.echo(json.dumps(reply, indent=2, ensure_ascii=False))


def _fail(command: str, exc: Exception) -> typer.Exit:
    typer.echo(f"openbook keys {command}: {exc}", err=True)
    return typer.Exit(1)


@keys_app.command("create")
def create_command(
    name: str = typer.Argument(..., help="the key's name (a-z, 0-9, '_', '-')"),
    scopes: list[str] = typer.Option(
        ..., "--scope", help="ask | write | indexes:create | admin (repeat for several)"
    ),
    indexes: list[str] | None = typer.Option(
        None, "--index", help="the only indexes the key may name (repeat); default: every one"
    ),
    tenant: str | None = typer.Option(
        None,
        "--filter",
        help='the tenant: a metadata filter as JSON ({"tenant": "acme"}) ANDed into every '
        "retrieval, stamped into every document the key writes",
    ),
    requests_per_minute: int | None = typer.Option(
        None, "--requests-per-minute", help="at most this many requests a minute (429 past it)"
    ),
    concurrent_generations: int | None = typer.Option(
        None, "--concurrent-generations", help="at most this many answers generated at once"
    ),
    url: str = URL,
    admin_token: str | None = TOKEN,
    timeout_s: float = TIMEOUT,
) -> None:
    """Make a key; prints {"name", "key"}: the secret is shown this once."""
    body: dict[str, Any] = {"name": name, "scopes": scopes}
    if indexes:
        body["indexes"] = indexes
    rate = {
        field: value
        for field, value in (
            ("requests_per_minute", requests_per_minute),
            ("concurrent_generations", concurrent_generations),
        )
        if value is not None
    }
    if rate:
        body["rate"] = rate
    try:
        if tenant is not None:
            try:
                body["filter"] = json.loads(tenant)
            except ValueError as exc:
                raise DocsError(f"--filter is not JSON: {exc}") from None
        _done(call(GatewayTarget(url, admin_token, timeout_s), "POST", ("admin", "keys"), body))
    except DocsError as exc:
        raise _fail("create", exc) from None


@keys_app.command("ls")
def ls_command(url: str = URL, admin_token: str | None = TOKEN, timeout_s: float = TIMEOUT) -> None:
    """Every key: name, scopes, indexes, when made and last used (never a secret)."""
    try:
        _done(call(GatewayTarget(url, admin_token, timeout_s), "GET", ("admin", "keys")))
    except DocsError as exc:
        raise _fail("ls", exc) from None


@keys_app.command("rm")
def rm_command(
    name: str,
    url: str = URL,
    admin_token: str | None = TOKEN,
    timeout_s: float = TIMEOUT,
) -> None:
    """Revoke a key: every gateway refuses it from the next request on."""
    try:
        _done(call(GatewayTarget(url, admin_token, timeout_s), "DELETE", ("admin", "keys", name)))
    except DocsError as exc:
        raise _fail("rm", exc) from None
