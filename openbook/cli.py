"""The ``openbook`` command: serve a service, start the stack, build indexes, check health."""

from __future__ import annotations

import importlib
import sys
from enum import StrEnum
from pathlib import Path

import click
import typer
from typer.core import TyperGroup

# Sub-commands that pull in torch and friends, imported only when invoked, so that light
# commands (health checks run every few seconds) start fast.
LAZY_COMMANDS = {
    "index": ("openbook.index.cli:app", "Build and inspect indexes."),
    "demo": ("openbook.demo.cli:app", "Demo data, indexes and default models."),
    "train": ("openbook_trainer.cli:app", "Fine-tune the query encoder and generator jointly."),
    "eval": ("openbook.evaluation.cli:app", "Score a running system or a checkpoint."),
    "experiments": ("openbook.experiments.cli:app", "The paper's experiments, in small."),
}


class LazyGroup(TyperGroup):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return [*super().list_commands(ctx), *LAZY_COMMANDS]

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in LAZY_COMMANDS:
            return super().get_command(ctx, name)
        target, help_text = LAZY_COMMANDS[name]
        module, attr = target.split(":")
        try:
            sub_app = getattr(importlib.import_module(module), attr)
        except ImportError as exc:
            raise click.ClickException(f"'{name}' is unavailable: {exc}") from None
        command = typer.main.get_command(sub_app)
        command.name = name
        command.help = command.help or help_text
        return command


app = typer.Typer(
    cls=LazyGroup,
    help="openbook: Retrieval-Augmented Generation served as microservices.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


class ServiceName(StrEnum):
    retriever = "retriever"
    generator = "generator"
    gateway = "gateway"


@app.command()
def serve(service: ServiceName) -> None:
    """Run one service in the foreground, configured by OPENBOOK_* environment variables."""
    from openbook.config import get_settings
    from openbook.logs import setup_logging

    settings = get_settings()
    setup_logging(settings.log_level)
    if service is ServiceName.retriever:
        from openbook_retriever.server import serve as serve_retriever

        serve_retriever(settings)
    elif service is ServiceName.generator:
        from openbook_generator.server import serve as serve_generator

        serve_generator(settings)
    else:
        import uvicorn

        from openbook_gateway.app import create_app

        uvicorn.run(
            create_app(settings),
            host=settings.gateway_host,
            port=settings.gateway_port,
            log_config=None,
            timeout_graceful_shutdown=10,
        )


@app.command()
def health(
    grpc_addr: str = typer.Option(None, "--grpc", help="host:port of a gRPC service"),
    http_url: str = typer.Option(None, "--http", help="URL that must answer 200"),
    timeout_s: float = typer.Option(2.0, "--timeout"),
) -> None:
    """Exit 0 when the service answers healthy (used by docker-compose healthchecks)."""
    if bool(grpc_addr) == bool(http_url):
        raise typer.BadParameter("give exactly one of --grpc or --http")
    if grpc_addr:
        from openbook.serving.grpc_server import check_health

        ok = check_health(grpc_addr, timeout_s)
    else:
        import httpx

        try:
            ok = httpx.get(http_url, timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            ok = False
    raise typer.Exit(0 if ok else 1)


@app.command("ask")
def ask_command(
    question: str,
    url: str = typer.Option("http://127.0.0.1:8000", envvar="OPENBOOK_URL", help="gateway URL"),
    k: int = typer.Option(5, min=1, max=100),
    decoding: str = typer.Option("rag-token", help="rag-token | rag-sequence-thorough | -fast"),
    num_beams: int = typer.Option(1, min=1, max=16),
    timeout_s: float = typer.Option(120.0, "--timeout"),
    as_json: bool = typer.Option(False, "--json", help="print the raw JSON reply"),
) -> None:
    """Ask a running system; show the answer, the passages' prior and posterior, and for
    RAG-Token the per-token posterior over passages."""
    import json

    import httpx

    from openbook.ask import ask, render

    try:
        answer = ask(url, question, k, decoding, num_beams, timeout_s)
    except (RuntimeError, httpx.HTTPError) as exc:
        typer.echo(f"openbook ask: {exc}", err=True)
        raise typer.Exit(1) from None
    if as_json:
        typer.echo(json.dumps(answer, indent=2))
    else:
        render(answer)


@app.command()
def up(
    compose_file: Path = typer.Option(Path("docker-compose.yml"), "--file", "-f"),
    services: list[str] = typer.Argument(None, help="services to start (default: all)"),
) -> None:
    """Start the services of docker-compose.yml as local processes (no Docker needed)."""
    from openbook.launcher import LaunchError, run_stack

    try:
        run_stack(compose_file, services or None)
    except LaunchError as exc:
        typer.echo(f"openbook up: {exc}", err=True)
        raise typer.Exit(1) from None


def main() -> None:
    sys.exit(app())
