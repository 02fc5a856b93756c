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
from openbook_cli.gateway_options import GatewayOptions, fail, reply

keys_app = typer.Typer(
    help="Keys with scopes (ask, write, indexes:create, admin), optionally held to indexes, a "
    "tenant's filter and a rate: create, ls, rm "
    "(the gateway's /admin/keys; needs OPENBOOK_ADMIN_TOKEN).",
    no_args_is_help=True,
)

_GATEWAY = GatewayOptions(30.0, "the admin token (or a key with the admin scope)")


@keys_app.command("create")
@_GATEWAY
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
    *,
    target: GatewayTarget,
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
    if tenant is not None:
        try:
            body["filter"] = json.loads(tenant)
        except ValueError as exc:
            raise fail("keys", "create", DocsError(f"--filter is not JSON: {exc}")) from None
    reply("keys", "create", lambda: call(target, "POST", ("admin", "keys"), body))


@keys_app.command("ls")
@_GATEWAY
def ls_command(*, target: GatewayTarget) -> None:
    """Every key: name, scopes, indexes, when made and last used (never a secret)."""
    reply("keys", "ls", lambda: call(target, "GET", ("admin", "keys")))


@keys_app.command("rm")
@_GATEWAY
def rm_command(name: str, *, target: GatewayTarget) -> None:
    """Revoke a key: every gateway refuses it from the next request on."""
    reply("keys", "rm", lambda: call(target, "DELETE", ("admin", "keys", name)))
