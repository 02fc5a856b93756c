"""Where openbook's Redis is when nothing says so, and one clear line when it cannot be reached.

``openbook up`` runs its own Redis. With ``OPENBOOK_REDIS_PORT`` unset it does not insist on
compose's default port: where another program (someone else's Redis, anything) holds it, it
takes the next free one (cli/openbook_cli/launcher.py). Either way it records how to reach its
Redis — the URL, user, password file and server key file the stack's services were given — in
``<var>/redis-endpoint.json`` (``OPENBOOK_VAR_DIR``, default ``./var``), so that services and
commands started by hand from the same checkout find that Redis without any variable:

1. ``OPENBOOK_REDIS_URL`` set: that URL, as always (an explicit Redis is never second-guessed);
2. else the record, when there is one and ``OPENBOOK_REDIS_PORT`` is unset or is its port;
3. else ``redis://127.0.0.1:${OPENBOOK_REDIS_PORT:-6379}/0``.

The record fills only what is not set explicitly (a password file given by the environment
wins). It outlives the stack on purpose: a command run while the stack is down is told the
recorded Redis is unreachable, instead of quietly writing to whatever holds port 6379.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

from openbook.errors import InvalidArgument

RECORD_NAME = "redis-endpoint.json"
DEFAULT_PORT = 6379
URL_VARIABLE = "OPENBOOK_REDIS_URL"
PORT_VARIABLE = "OPENBOOK_REDIS_PORT"
VAR_DIR_VARIABLE = "OPENBOOK_VAR_DIR"


def default_url(port: int | None = None) -> str:
    return f"redis://127.0.0.1:{port or DEFAULT_PORT}/0"


@dataclass(frozen=True)
class RedisEndpoint:
    """How to reach one Redis. Paths are absolute in a record (it is read from any folder)."""

    url: str
    username: str | None = None
    password_file: str | None = None
    server_key_file: str | None = None
    tls_ca_file: str | None = None


def record_path(var_dir: Path | str | None) -> Path:
    """The record under ``var_dir`` (None: ``./var``, compose's default)."""
    return Path(var_dir or "var") / RECORD_NAME


def write_record(path: Path, endpoint: RedisEndpoint) -> None:
    """Write the record atomically (a reader never sees half of it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as out:
        json.dump({k: v for k, v in asdict(endpoint).items() if v}, out, indent=2)
        out.write("\n")
    os.replace(tmp, path)


def read_record(path: Path) -> RedisEndpoint | None:
    """The endpoint recorded at ``path``; None if there is none.
    :class:`~openbook.errors.InvalidArgument` (a ``ValueError``) naming the file if it is there
    but unreadable (never silently another Redis)."""
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise InvalidArgument(
            f"{path}: unreadable Redis endpoint record ({exc}); delete it"
        ) from None
    if not isinstance(raw, dict) or not isinstance(raw.get("url"), str):
        raise InvalidArgument(f"{path}: not a Redis endpoint record (no url); delete it")
    fields = ("username", "password_file", "server_key_file", "tls_ca_file")
    return RedisEndpoint(raw["url"], **{k: raw[k] for k in fields if isinstance(raw.get(k), str)})


def port_of(url: str) -> int | None:
    """The TCP port of a ``redis://`` / ``rediss://`` URL (None for a Unix socket or none)."""
    try:
        parts = urlsplit(url)
        return parts.port if parts.scheme in ("redis", "rediss") else None
    except ValueError:
        return None


def redacted(url: str) -> str:
    """``url`` without a password (``redis://user:***@host``): safe to print and log."""
    return re.sub(r"(//[^/@:]*):[^/@]*@", r"\1:***@", url)


def resolve(
    port: int | None, recorded: RedisEndpoint | None, record: Path
) -> tuple[str, RedisEndpoint | None, str]:
    """Which Redis a process without ``OPENBOOK_REDIS_URL`` uses (the module docstring's
    order), given ``OPENBOOK_REDIS_PORT`` and the record read from ``record``: (its URL, the
    record when that is what applies, where the URL came from, for messages)."""
    if recorded is not None and (port is None or port == port_of(recorded.url)):
        return recorded.url, recorded, f"recorded by openbook up in {record.resolve()}"
    if port is not None:
        return default_url(port), None, PORT_VARIABLE
    return default_url(), None, f"the default ({URL_VARIABLE} unset)"


@dataclass(frozen=True)
class Problem:
    """Why Redis cannot be used, in one line; ``bad_url``: the URL itself is wrong (nothing
    will ever answer at it), not the server."""

    message: str
    bad_url: bool = False


def problem(
    url: str, source: str, client_kwargs: dict, username: str | None = None
) -> Problem | None:
    """None if Redis at ``url`` answers (as ``username``, with ``client_kwargs``' password);
    else why not, naming it, where the URL came from and what to set."""
    where = f"Redis at {redacted(url)} ({source})"
    fix = (
        f"set {URL_VARIABLE} to the Redis to use (for openbook up: leave {PORT_VARIABLE} "
        "unset, or set it to a free port)"
    )
    if source.startswith("recorded"):
        fix = f"is `openbook up` running? Otherwise {fix}"
    # why: the launcher and the light commands read records without loading redis-py
    import redis

    try:
        redis.Redis.from_url(url, **client_kwargs).ping()
    except ValueError as exc:
        return Problem(f"{where} is not a Redis URL ({exc}): {fix}", bad_url=True)
    except redis.AuthenticationError as exc:
        who = f"user {username}" if username else "a client without a password"
        return Problem(f"{where} refuses {who} ({exc}): is it this deployment's Redis? {fix}")
    except redis.ResponseError as exc:
        return Problem(f"{where} refuses openbook's commands ({exc}): {fix}")
    except (redis.RedisError, OSError) as exc:
        return Problem(f"{where} is unreachable ({exc}): {fix}")
    return None
