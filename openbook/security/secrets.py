"""A deployment's secrets, generated once on first start (the command ``openbook-secrets``,
deploy/openbook_deploy/secrets.py, runs :func:`init`).

:func:`init` creates under a folder, when missing, three files of mode 0600:

- ``redis-password``: the password of the ``openbook`` Redis user (32 random bytes, URL-safe);
- ``redis-users.acl``: Redis's ACL file: the ``default`` user off (nobody gets in without the
  password) and ``openbook`` allowed only what openbook's clients use (see :data:`ACL_RULES`);
- ``server-key``: the key of the MACs sealing what openbook keeps in Redis
(openbook.security.sealing).

Invariants: existing secrets are never rotated (running it on every start is safe, and every
service keeps reading the same values); each file appears whole or not at all (written under a
temporary name, then hard-linked in place, so two concurrent starts agree on one value).
Every service reads them with :func:`read_secret`; the test kit starts its Redis from the same
files.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from openbook.errors import InvalidArgument

PASSWORD_FILE = "redis-password"
ACL_FILE = "redis-users.acl"
SERVER_KEY_FILE = "server-key"
REDIS_USER = "openbook"

# Least privilege that still lets openbook's clients work: its keys and channels only
# (every key is ``openbook:*``), the read/write/pub-sub/transaction commands they send
# (GET, SET, HSET, HGETALL, HSETNX, DEL, SCAN, PUBLISH, SUBSCRIBE, MULTI/EXEC, PING), and
# nothing @dangerous (FLUSHALL, KEYS, CONFIG, DEBUG, CLIENT, ACL, MODULE, ...) or scripting.
ACL_RULES = (
    "~openbook:* resetchannels &openbook:* -@all "
    "+@read +@write +@keyspace +@pubsub +@transaction +@connection -@dangerous "
    # Health checks ask who they are: only a client that authenticated as openbook is healthy.
    "+acl|whoami"
)


@dataclass(frozen=True)
class SecretFiles:
    """Where one deployment's secrets are (all in ``dir``)."""

    dir: Path

    @property
    def password(self) -> Path:
        return self.dir / PASSWORD_FILE

    @property
    def acl(self) -> Path:
        return self.dir / ACL_FILE

    @property
    def server_key(self) -> Path:
        return self.dir / SERVER_KEY_FILE


def acl_text(password: str, user: str = REDIS_USER) -> str:
    """Redis's ACL file for ``password``: stored as its SHA-256, never in clear."""
    digest = hashlib.sha256(password.encode()).hexdigest()
    return f"user default off\nuser {user} on #{digest} {ACL_RULES}\n"


@contextlib.contextmanager
def _private_copy(path: Path, content: str) -> Iterator[Path]:
    """A temporary file beside ``path`` holding ``content``, mode 0600 whatever the umask,
    for the caller to link or rename into place; removed afterwards if it is still there."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(content)
        os.chmod(tmp, 0o600)  # whatever the umask
        yield tmp
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _create_once(path: Path, content: str) -> bool:
    """Write ``content`` to ``path`` (mode 0600) unless it exists; True if this call made it.

    Written to a private temporary file and hard-linked into place: the link fails if another
    process got there first, so readers never see a half-written secret and the first writer
    wins."""
    if path.exists():
        return False
    with _private_copy(path, content) as tmp:
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        return True


def _replace(path: Path, content: str) -> None:
    """Write ``content`` to ``path`` (mode 0600) by an atomic rename: a concurrent reader sees
    the old file or the new one, never none (the ACL's content follows from the password, so
    concurrent writers agree on it)."""
    with _private_copy(path, content) as tmp:
        os.replace(tmp, path)


def read_secret(path: Path, what: str) -> str:
    """The stripped content of a secret file, or a ``SystemExit``-worthy
    :class:`~openbook.errors.InvalidArgument` (a ``ValueError``) that names the file and the
    setting it is for."""
    try:
        value = Path(path).read_text().strip()
    except OSError as exc:
        raise InvalidArgument(
            f"{what} file {path}: cannot read it ({exc.strerror or exc})"
        ) from exc
    if not value:
        raise InvalidArgument(f"{what} file {path}: empty")
    return value


def init(directory: Path, acl_owner: int | None = None) -> SecretFiles:
    """Create what is missing under ``directory``; never rotate what exists.

    ``acl_owner``: uid to give the ACL file to (the Redis container's user, which must read
    it while it stays 0600)."""
    files = SecretFiles(Path(directory))
    files.dir.mkdir(parents=True, exist_ok=True)
    os.chmod(files.dir, 0o700)
    _create_once(files.password, secrets.token_urlsafe(32) + "\n")
    _create_once(files.server_key, secrets.token_urlsafe(32) + "\n")
    password = read_secret(files.password, "redis password")
    # The ACL follows the password: rewritten if missing or stale (the password never moves).
    wanted = acl_text(password)
    try:
        current = files.acl.read_text()
    except FileNotFoundError:
        current = None
    if current != wanted:
        _replace(files.acl, wanted)
    if acl_owner is not None and os.geteuid() == 0:
        # In a container (root): Redis's image drops to its own user, which must read it.
        # Run as a user, Redis runs as that user too: nothing to give away.
        os.chown(files.acl, acl_owner, -1)
    return files
