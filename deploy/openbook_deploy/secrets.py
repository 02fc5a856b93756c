"""A deployment's secrets, generated once on first start: ``openbook-secrets``.

``openbook-secrets init --dir DIR`` creates, when missing, the three files of
:mod:`openbook.security.secrets` (mode 0600): Redis's password and ACL file and the server key.
Existing secrets are never rotated (running it on every start is safe) and ``init`` prints no
secret.

For Kubernetes, ``openbook-secrets k8s`` prints the Secret ``openbook-redis`` holding the same
three files (made under ``--dir`` if missing, so running it again prints the same values):
``openbook-secrets k8s | kubectl apply -f -`` (docs/security.md). ``openbook-secrets
k8s-ensure``, run in a pod (the Job deploy/k8s/base/secrets-job.yaml), makes that Secret itself
on first start through the Kubernetes API (the official ``kubernetes`` client) with the pod's
service account, and leaves it alone when it exists (HTTP 409): never rotated either.

compose runs ``init`` as a one-shot service before Redis starts, ``openbook up`` runs the same
(docker-compose.yml); both run in the gateway's image, which installs this package.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from openbook.security.secrets import init, read_secret

K8S_SECRET = "openbook-redis"
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


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
        ``_PORT``. ``api_url`` and ``namespace`` override them (the client's own in-cluster
        loader takes neither, nor a folder without a CA)."""
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

    def configuration(self) -> client.Configuration:
        """The API client's configuration: this server, this token, this CA; no retries (the
        Job restarts on failure)."""
        configuration = client.Configuration(host=self.api_url)
        configuration.api_key = {"BearerToken": self.token}
        configuration.api_key_prefix = {"BearerToken": "Bearer"}
        configuration.ssl_ca_cert = str(self.ca_file) if self.ca_file else None
        configuration.retries = False
        return configuration


def k8s_ensure(cluster: InCluster, timeout: float = 30.0) -> bool:
    """Create Secret ``openbook-redis`` in ``cluster.namespace`` unless it exists; True if this
    call made it. An existing Secret (HTTP 409) is never read nor changed, so every service
    keeps the password it has; other refusals raise :class:`K8sApiError`.

    The values are made by :func:`openbook.security.secrets.init` in a private temporary folder
    (removed at once): the same files, mode and ACL as compose's ``init``."""
    with tempfile.TemporaryDirectory(prefix="openbook-secrets-") as tmp:
        body = client.V1Secret.model_validate(k8s_secret(Path(tmp) / "secrets", cluster.namespace))
    with client.ApiClient(cluster.configuration()) as api:
        try:
            client.CoreV1Api(api).create_namespaced_secret(
                cluster.namespace,
                body,
                _request_timeout=timeout,
                # the client leaves it out for a JSON body; say what it is
                _headers={"Content-Type": "application/json"},
            )
            return True
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise K8sApiError(_refusal(exc, cluster)) from exc
        except HTTPError as exc:
            raise K8sApiError(
                f"cannot reach the Kubernetes API at {cluster.api_url}: {exc}"
            ) from exc


def _refusal(exc: ApiException, cluster: InCluster) -> str:
    """A message for an API refusal: the server's own reason, and what to fix."""
    try:
        reason = json.loads(exc.body or "{}").get("message", "")
    except (ValueError, AttributeError):
        reason = ""
    reason = reason or exc.reason
    what = f"creating Secret {K8S_SECRET} in namespace {cluster.namespace}: HTTP {exc.status}"
    if exc.status in (401, 403):
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
