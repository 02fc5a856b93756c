"""The ``openbook`` command: start the stack, ask it, and every service's own commands.

It is the one package that knows every service (it depends on all four); the core library and
the services never import it. ``openbook serve <service>`` runs exactly what that service's own
command (``openbook-<service>``, what the images run) runs; the jobs' sub-commands are those of
``openbook-trainer``.
"""

from __future__ import annotations

import importlib
import json
import sys
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import typer
from typer.core import TyperGroup

from openbook.config.redis_endpoint import redacted
from openbook_cli.ask import AskOptions, ask, render
from openbook_cli.docs_commands import docs_app
from openbook_cli.keys_commands import keys_app
from openbook_cli.launcher import LaunchError, run_stack

if TYPE_CHECKING:  # typer vendors click: its groups take and return typer's own click objects
    from typer._click.core import Command, Context

# openbook-trainer's sub-commands: they pull in torch and friends, so they are imported only
# when invoked and light commands (up, ask, health) start fast.
LAZY_COMMANDS = ("train", "merge-adapter", "eval", "demo", "experiments", "index")


class LazyGroup(TyperGroup):
    def list_commands(self, ctx: Context) -> list[str]:
        return [*super().list_commands(ctx), *LAZY_COMMANDS]

    def get_command(self, ctx: Context, name: str) -> Command | None:
        if name not in LAZY_COMMANDS:
            return super().get_command(ctx, name)
        # why: torch stays out of the light commands (up, ask): the jobs load when invoked
        from openbook_trainer.__main__ import command_group

        return command_group().get_command(ctx, name)


app = typer.Typer(
    cls=LazyGroup,
    help="openbook: Retrieval-Augmented Generation served as microservices.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(docs_app, name="docs")
app.add_typer(keys_app, name="keys")


class ServiceName(StrEnum):
    retriever = "retriever"
    generator = "generator"
    gateway = "gateway"


@app.command()
def serve(service: ServiceName) -> None:
    """Run one service in the foreground, as its own command (``openbook-<service>``) does."""
    module = importlib.import_module(f"openbook_{service.value}.__main__")
    module.main()


@app.command("ask")
def ask_command(
    question: str,
    url: str = typer.Option("http://127.0.0.1:8000", envvar="OPENBOOK_URL", help="gateway URL"),
    k: int = typer.Option(5, min=1, max=100),
    decoding: str = typer.Option("rag-token", help="rag-token | rag-sequence-thorough | -fast"),
    num_beams: int = typer.Option(1, min=1, max=16),
    retrieval: str | None = typer.Option(
        None, help="dense | bm25 | hybrid (default: the index's default_retrieval)"
    ),
    min_confidence: float | None = typer.Option(
        None, min=0.0, max=1.0, help="abstain below this confidence (default: the server's)"
    ),
    timeout_s: float = typer.Option(120.0, "--timeout"),
    as_json: bool = typer.Option(False, "--json", help="print the raw JSON reply"),
) -> None:
    """Ask a running system; show the answer and its confidence, the passages' prior and
    posterior, and for RAG-Token the per-token posterior over passages."""
    options = AskOptions(k, decoding, num_beams, retrieval, min_confidence)
    try:
        answer = ask(url, question, options, timeout_s)
    except (RuntimeError, httpx.HTTPError) as exc:
        typer.echo(f"openbook ask: {exc}", err=True)
        raise typer.Exit(1) from None
    if as_json:
        typer.echo(json.dumps(answer, indent=2))
    else:
        render(answer)


@app.command("mcp")
def mcp_command(
    url: str = typer.Option("http://127.0.0.1:8000", envvar="OPENBOOK_URL", help="gateway URL"),
    api_key: str | None = typer.Option(
        None, envvar="OPENBOOK_API_KEY", help="one of the gateway's OPENBOOK_GATEWAY_API_KEYS"
    ),
    admin_token: str | None = typer.Option(
        None, envvar="OPENBOOK_ADMIN_TOKEN", help="the admin token: opens the write tools"
    ),
    timeout_s: float = typer.Option(120.0, "--timeout", min=1.0),
) -> None:
    """Serve openbook's MCP tools over stdio (for MCP clients that launch a command): a relay
    to the gateway's /mcp, which runs them."""
    # why: the MCP SDK loads only for this command, not for up/ask
    import anyio

    from openbook_cli.mcp_relay import RelayOptions, first_cause, serve_stdio

    options = RelayOptions(url, api_key or None, admin_token or None, timeout_s)
    try:
        anyio.run(serve_stdio, options)
    except KeyboardInterrupt:
        pass
    except Exception as exc:  # noqa: BLE001 - a start that fails says why on stderr, not a trace
        typer.echo(f"openbook mcp: gateway at {options.endpoint}: {first_cause(exc)}", err=True)
        raise typer.Exit(1) from None


@app.command("redis")
def redis_command() -> None:
    """Say which Redis the services and commands run here use (OPENBOOK_REDIS_URL, else the
    one `openbook up` recorded under var/, else 127.0.0.1:6379) and whether it answers."""
    # why: pydantic settings and redis-py load only for this command
    from openbook.config.settings import CommonSettings

    settings = CommonSettings()
    problem = settings.redis_problem()
    if problem is not None:
        typer.echo(f"openbook redis: {problem.message}", err=True)
        raise typer.Exit(1)
    who = f" as user {settings.redis_username}" if settings.redis_password_file else ""
    typer.echo(f"{redacted(settings.redis_url)} ({settings.redis_source}): answers{who}")


@app.command()
def up(
    compose_file: Path = typer.Option(Path("docker-compose.yml"), "--file", "-f"),
    services: list[str] = typer.Argument(None, help="services to start (default: all)"),
) -> None:
    """Start the services of docker-compose.yml as local processes (no Docker needed)."""
    try:
        run_stack(compose_file, services or None)
    except LaunchError as exc:
        typer.echo(f"openbook up: {exc}", err=True)
        raise typer.Exit(1) from None


def main() -> None:
    sys.exit(app())
