"""``openbook-health``: exit 0 when a service answers healthy, 1 otherwise.

Every image's healthcheck runs it every few seconds, so it imports neither torch nor a web
framework: a gRPC health check (``--grpc host:port``) or an HTTP GET that must answer 200
(``--http URL``).
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request

from openbook.serving.grpc_server import check_health


def http_ok(url: str, timeout_s: float) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:  # noqa: S310 (probe URL)
            return reply.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="openbook-health", description=__doc__.splitlines()[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--grpc", metavar="HOST:PORT", help="a gRPC service's address")
    target.add_argument("--http", metavar="URL", help="a URL that must answer 200")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds (default 2)")
    args = parser.parse_args(argv)
    ok = check_health(args.grpc, args.timeout) if args.grpc else http_ok(args.http, args.timeout)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
