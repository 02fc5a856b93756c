"""A deployment's secrets, generated once on first start: ``openbook-secrets``.

``openbook-secrets init --dir DIR`` creates, when missing, three files of mode 0600:

- ``redis-password``: the password of the ``openbook`` Redis user (32 random bytes, URL-safe);
- ``redis-users.acl``: Redis's ACL file: the ``default`` user off (nobody gets in without the
  password) and ``openbook`` allowed only what openbook's clients use (see :data:`ACL_RULES`);
- ``server-key``: the key of the MACs sealing what openbook keeps in Redis (openbook.sealing).

Invariants: existing secrets are never rotated (running it on every start is safe, and every
service keeps reading the same values); each file appears whole or not at all (written under a
temporary name, then hard-linked in place, so two concurrent starts agree on one value);
``init`` prints no secret. For Kubernetes, ``openbook-secrets k8s`` prints the Secret
``openbook-redis`` holding the same three files (made under ``--dir`` if missing, so running it
again prints the same values): ``openbook-secrets k8s | kubectl apply -f -`` (docs/security.md).
``openbook-secrets k8s-ensure``, run in a pod (the Job deploy/k8s/base/secrets-job.yaml), makes
that Secret itself on first start through the Kubernetes API with the pod's service account, and
leaves it alone when it exists (HTTP 409): never rotated either.

compose runs ``init`` as a one-shot service before Redis starts, ``openbook up`` runs the same
(docker-compose.yml), the test kit starts its Redis from the same files.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import secrets
import ssl
import sys
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

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


def _create_once(path: Path, content: str) -> bool:
    """Write ``content`` to ``path`` (mode 0600) unless it exists; True if this call made it.

    Written to a private temporary file and hard-linked into place: the link fails if another
    process got there first, so readers never see a half-written secret and the first writer
    wins."""
    if path.exists():
        return False
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(content)
        os.chmod(tmp, 0o600)  # whatever the umask
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _replace(path: Path, content: str) -> None:
    """Write ``content`` to ``path`` (mode 0600) by an atomic rename: a concurrent reader sees
    the old file or the new one, never none (the ACL's content follows from the password, so
    concurrent writers agree on it)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(content)
        os.chmod(tmp, 0o600)  # whatever the umask
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def read_secret(path: Path, what: str) -> str:
    """The stripped content of a secret file, or a ``SystemExit``-worthy ``ValueError`` that
    names the file and what it is for."""
    try:
        value = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"{what} file {path}: cannot read it ({exc.strerror or exc})") from exc
    if not value:
        raise ValueError(f"{what} file {path}: empty")
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


K8S_SECRET = "openbook-redis"


def k8s_secret(directory: Path, namespace: str = "openbook") -> dict:
    """The Kubernetes Secret ``openbook-redis`` (deploy/k8s mounts it) of the secrets under
    ``directory``, made there first if missing: its keys are the file names."""
    files = init(directory)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": K8S_SECRET,
            "namespace": namespace,
            "labels": {"app.kubernetes.io/part-of": "openbook"},
        },
        "type": "Opaque",
        "stringData": {
            path.name: path.read_text() for path in (files.password, files.acl, files.server_key)
        },
    }


SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


class K8sApiError(RuntimeError):
    """The API server refused or could not be reached; the message says what to fix."""


@dataclass(frozen=True)
class InCluster:
    """How a pod reaches the Kubernetes API as its service account.

    ``api_url`` has no trailing slash; ``ca_file`` verifies an https server (None: plain
    http, for tests only)."""

    api_url: str
    token: str
    namespace: str
    ca_file: Path | None = None

    @classmethod
    def from_pod(
        cls,
        service_account_dir: Path = SERVICE_ACCOUNT_DIR,
        api_url: str | None = None,
        namespace: str | None = None,
    ) -> InCluster:
        """What the kubelet gives every pod: the token, CA and namespace files under
        ``service_account_dir``, the API server's address in ``KUBERNETES_SERVICE_HOST`` and
        ``_PORT``. ``api_url`` and ``namespace`` override them."""
        sa = Path(service_account_dir)
        if api_url is None:
            host = os.environ.get("KUBERNETES_SERVICE_HOST")
            port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
            if not host:
                raise ValueError(
                    "KUBERNETES_SERVICE_HOST is not set: not in a pod? (or pass --api-url)"
                )
            host = f"[{host}]" if ":" in host else host  # an IPv6 address
            api_url = f"https://{host}:{port}"
        token = read_secret(sa / "token", "service account token")
        if namespace is None:
            namespace = read_secret(sa / "namespace", "service account namespace")
        ca = sa / "ca.crt"
        return cls(
            api_url=api_url.rstrip("/"),
            token=token,
            namespace=namespace,
            ca_file=ca if ca.exists() else None,
        )


def k8s_ensure(cluster: InCluster, timeout: float = 30.0) -> bool:
    """Create Secret ``openbook-redis`` in ``cluster.namespace`` unless it exists; True if this
    call made it. An existing Secret (HTTP 409) is never read nor changed, so every service
    keeps the password it has; other refusals raise :class:`K8sApiError`.

    The values are made by :func:`init` in a private temporary folder (removed at once): the
    same files, mode and ACL as compose's ``init``."""
    with tempfile.TemporaryDirectory(prefix="openbook-secrets-") as tmp:
        body = k8s_secret(Path(tmp) / "secrets", cluster.namespace)
    url = f"{cluster.api_url}/api/v1/namespaces/{cluster.namespace}/secrets"
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={
            "Authorization": f"Bearer {cluster.token}",
            "Content-Type": "application/json",
            "Accept": "application/json",
        },
    )
    context = None
    if url.startswith("https:"):
        context = ssl.create_default_context(
            cafile=str(cluster.ca_file) if cluster.ca_file else None
        )
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context):
            return True
    except urllib.error.HTTPError as exc:
        if exc.code == 409:
            return False
        raise K8sApiError(_refusal(exc, cluster)) from exc
    except urllib.error.URLError as exc:
        raise K8sApiError(f"cannot reach the Kubernetes API at {url}: {exc.reason}") from exc


def _refusal(exc: urllib.error.HTTPError, cluster: InCluster) -> str:
    """A message for an API refusal: the server's own reason, and what to fix."""
    try:
        reason = json.loads(exc.read() or b"{}").get("message", "")
    except ValueError:
        reason = ""
    reason = reason or exc.reason
    what = f"creating Secret {K8S_SECRET} in namespace {cluster.namespace}: HTTP {exc.code}"
    if exc.code in (401, 403):
        return (
            f"{what} ({reason}); the pod's service account needs RBAC `create` on secrets "
            "in its namespace (Role and RoleBinding openbook-secrets, deploy/k8s/base)"
        )
    return f"{what} ({reason})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="openbook-secrets", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_init = sub.add_parser("init", help="create the secrets that are missing (never rotates)")
    p_init.add_argument("--dir", type=Path, default=Path("var/secrets"))
    p_init.add_argument(
        "--acl-owner",
        type=int,
        default=None,
        help="uid that gets the ACL file when run as root (the Redis container's user)",
    )
    p_k8s = sub.add_parser("k8s", help="print the Secret openbook-redis for kubectl apply -f -")
    p_k8s.add_argument("--dir", type=Path, default=Path("var/secrets"))
    p_k8s.add_argument("--namespace", default="openbook")
    p_ensure = sub.add_parser(
        "k8s-ensure",
        help="in a pod: create the Secret openbook-redis unless it exists (never rotates)",
    )
    p_ensure.add_argument("--service-account-dir", type=Path, default=SERVICE_ACCOUNT_DIR)
    p_ensure.add_argument(
        "--api-url", default=None, help="default: https://$KUBERNETES_SERVICE_HOST:_PORT"
    )
    p_ensure.add_argument(
        "--namespace", default=None, help="default: the service account's namespace"
    )
    args = parser.parse_args(argv)
    try:
        if args.command == "k8s-ensure":
            cluster = InCluster.from_pod(args.service_account_dir, args.api_url, args.namespace)
            made = k8s_ensure(cluster)
            state = "created" if made else "exists, left as it is"
            print(f"openbook-secrets: Secret {cluster.namespace}/{K8S_SECRET} {state}")
            return 0
        if args.command == "k8s":
            # JSON is YAML: kubectl apply -f - reads it as it is.
            print(json.dumps(k8s_secret(args.dir, args.namespace), indent=2))
            return 0
        files = init(args.dir, args.acl_owner)
        print(f"openbook-secrets: secrets ready in {files.dir}")
    except (OSError, ValueError, K8sApiError) as exc:
        print(f"openbook-secrets: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
