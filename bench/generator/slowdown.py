"""What the generator's speed model reads while it serves: its slowdowns (prefill, step,
scoring; openbook_generator/speed.py) after each of a run of requests, from the service's
``openbook_generator_slowdown`` metric.

Starts the generator as users run it (``python -m openbook_generator``, the default settings
unless given) and sends it default questions (k=5, greedy), one at a time: with
``--passages new`` every request brings passages the service has not seen, with ``--passages
same`` every request the same five, which the passage cache then gives (their heads are not
prefilled again). A slowdown far from 1 that keeps moving under steady traffic is the speed
model misreading the work it is told about: admission plans every request with it
(docs/serving.md, "Admission").

    .venv/bin/python bench/generator/slowdown.py --passages same --json same.json
    .venv/bin/python bench/generator/slowdown.py --passages new --json new.json
    # another tree's service (git worktree add /work/bl-X X):
    .venv/bin/python bench/generator/slowdown.py \
        --env PYTHONPATH=/work/bl-X:/work/bl-X/services/generator --json X.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

QUESTION = "who wrote it?"
K = 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slowdowns(metrics_port: int) -> dict[str, float]:
    """The slowdown metric by kind, as a scrape reads it."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read()
    out = {}
    for line in text.decode().splitlines():
        if line.startswith("openbook_generator_slowdown{"):
            kind = line.split('kind="', 1)[1].split('"', 1)[0]
            out[kind] = round(float(line.split()[-1]), 3)
    return out


def _wait_serving(stub, service: subprocess.Popen, log: Path, timeout_s: float = 600) -> None:
    from openbook.v1 import generator_pb2

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if service.poll() is not None:
            raise RuntimeError(log.read_text()[-3000:])
        try:
            stub.Info(generator_pb2.InfoRequest(), timeout=2)
            return
        except Exception:  # noqa: BLE001 - not serving yet
            time.sleep(1)
    raise RuntimeError("the generator did not start")


def run(args: argparse.Namespace) -> dict:
    import grpc

    from openbook.v1 import common_pb2, generator_pb2, generator_pb2_grpc

    with sqlite3.connect(args.index / "passages.sqlite") as con:
        rows = con.execute(
            "select id, title, text from passages limit ?", (K * args.requests,)
        ).fetchall()
    work = Path(tempfile.mkdtemp(prefix="openbook-slowdown-"))
    redis_port, port, metrics_port = _free_port(), _free_port(), _free_port()
    redis = subprocess.Popen(
        [shutil.which("redis-server") or "redis-server", "--port", str(redis_port)]
        + ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(work)],
        stdout=subprocess.DEVNULL,
    )
    env = {
        **os.environ,
        "OPENBOOK_GENERATOR_MODEL": str(args.model.resolve()),
        "OPENBOOK_GENERATOR_ADAPTER": str(args.adapter.resolve()) if args.adapter else "",
        "OPENBOOK_GENERATOR_PORT": str(port),
        "OPENBOOK_GENERATOR_METRICS_PORT": str(metrics_port),
        "OPENBOOK_GENERATOR_CHECKPOINT_DIR": str(work / "checkpoints"),
        "OPENBOOK_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
    }
    for pair in args.env:
        name, _, value = pair.partition("=")
        env[name] = value
    # ``python -m`` puts its working directory first on the import path: a tree given by
    # PYTHONPATH is only imported (rather than this checkout's ``openbook``) when the service
    # runs in it
    cwd = env["PYTHONPATH"].split(os.pathsep)[0] if env.get("PYTHONPATH") else None
    log_path = work / "generator.log"
    log = open(log_path, "w")  # noqa: SIM115 - closed below
    service = subprocess.Popen(
        [sys.executable, "-m", "openbook_generator"],
        env=env,
        stdout=log,
        stderr=log,
        cwd=cwd,
    )
    results: dict = {"passages": args.passages, "requests": []}
    try:
        stub = generator_pb2_grpc.GeneratorStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        _wait_serving(stub, service, log_path)
        results["start"] = _slowdowns(metrics_port)
        print("start", json.dumps(results["start"]), flush=True)
        for i in range(args.requests):
            at = 0 if args.passages == "same" else i * K
            passages = [
                common_pb2.Passage(id=str(pid), title=title, text=text, score=0.0)
                for pid, title, text in rows[at : at + K]
            ]
            started = time.perf_counter()
            stub.Generate(
                generator_pb2.GenerateRequest(question=QUESTION, passages=passages), timeout=120
            )
            row = {"seconds": round(time.perf_counter() - started, 3), **_slowdowns(metrics_port)}
            results["requests"].append(row)
            print(i, json.dumps(row), flush=True)
    finally:
        service.terminate()
        service.wait(30)
        redis.terminate()
        redis.wait(10)
        log.close()
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, default=Path("var/models/gemma-3-270m"))
    ap.add_argument("--adapter", type=Path, default=Path("var/models/gemma-3-270m-squad-lora"))
    ap.add_argument("--index", type=Path, default=Path("var/indexes/wiki-2018"))
    ap.add_argument("--passages", choices=("same", "new"), default="same")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument(
        "--env", nargs="*", default=[], help="NAME=VALUE for the service (PYTHONPATH: a tree)"
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    results = run(args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
