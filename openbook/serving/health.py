"""``openbook-health``: exit 0 when a service answers healthy, 1 otherwise.

Every image's healthcheck runs it every few seconds, so it imports neither torch nor a web
framework: a gRPC health check (``--grpc host:port``), an HTTP GET that must answer 200
(``--http URL``), or Milvus's own health RPC (``--milvus host:port``: a Milvus server, or the
``milvus-lite server`` that ``openbook up`` runs for the ``milvus`` service).
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request

import grpc

from openbook.serving.grpc_server import check_health


def http_ok(url: str, timeout_s: float) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:  # noqa: S310 (probe URL)
            return reply.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def milvus_ok(address: str, timeout_s: float) -> bool:
    """Whether the Milvus at ``address`` (host:port) answers its CheckHealth RPC healthy."""
    # why: pymilvus (the retriever's) stays out of the other probes and the images without it
    from pymilvus.grpc_gen import milvus_pb2, milvus_pb2_grpc

    try:
        with grpc.insecure_channel(address) as channel:
            stub = milvus_pb2_grpc.MilvusServiceStub(channel)
            reply = stub.CheckHealth(milvus_pb2.CheckHealthRequest(), timeout=timeout_s)
    except grpc.RpcError:
        return False
    return bool(reply.isHealthy)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="openbook-health", description=__doc__.splitlines()[0])
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--grpc", metavar="HOST:PORT", help="a gRPC service's address")
    target.add_argument("--http", metavar="URL", help="a URL that must answer 200")
    target.add_argument("--milvus", metavar="HOST:PORT", help="a Milvus server's address")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds (default 2)")
    args = parser.parse_args(argv)
    if args.grpc:
        ok = check_health(args.grpc, args.timeout)
    elif args.milvus:
        ok = milvus_ok(args.milvus, args.timeout)
    else:
        ok = http_ok(args.http, args.timeout)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
