"""Generator throughput with a neighbour spinning on one core: threads fixed at 2, fixed at 1,
and sized automatically (openbook/runtime/compute_threads.py). Issue 29: on a 2-core machine a team
of two compute threads answered nothing while a ``while True: pass`` held one core.

    .venv/bin/python bench/threads/run.py                    # 4 clients, 60 s per phase
    .venv/bin/python bench/threads/run.py --seconds 10 --json var/bench/threads.json

For each thread mode (``OPENBOOK_COMPUTE_THREADS`` = 2, 1, 0 = automatic; ``OMP_NUM_THREADS``
removed from the service's environment) one generator service is started as users run it
(``python -m openbook_generator``), warmed up, then measured in two phases of ``--seconds``
each, with ``--clients`` clients sending requests back to back:

* **quiet**: nothing else started by the benchmark;
* **hog**: a :class:`~openbook_testkit.hog.CpuHog` spinning on the last CPU this process may use,
  started when the phase starts (so the automatic mode is measured adapting, not adapted).

Per phase: answers/s, generated tokens/s, errors by gRPC status, and the compute threads the
service reported on /metrics (``openbook_compute_threads``, sampled every 0.5 s: the values
seen). Ratios are against the quiet fixed-2 phase of the same run.

Requests: a question with ``--k`` passages of ``--words`` words and exactly ``--new-tokens``
new tokens (``min_new_tokens`` = ``max_new_tokens``), so every answer is the same work. The model:
``--model`` when it exists (the default stack's ``var/models/gemma-3-270m``), else a random
model of Gemma 3 270M's transformer shape (640 wide, 18 layers, 4 heads of 256, 2048 MLP) with
a 300-token vocabulary — the layers' work of the real model without its 262k-row output layer —
built once under ``var/bench/threads-model``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

MODES = (("fixed 2", "2"), ("fixed 1", "1"), ("auto", "0"))
GAUGE = re.compile(r'^openbook_compute_threads\{service="generator"\} (\S+)$', re.M)
_TEXT = (
    "the council met in the old hall to measure the river and the bridge that the city had "
    "built after the long winter when the harbour froze and the ships waited for spring while "
    "merchants counted grain and the library kept records of every"
)
WORDS = _TEXT.split(" ")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shaped_model(directory: Path) -> Path:
    """A random model of Gemma 3 270M's transformer shape (module docstring), built once."""
    if (directory / "model.safetensors").exists():
        return directory
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from openbook_testkit.rag import make_tiny_causal_lm

    make_tiny_causal_lm(directory, arch="gemma3", sliding_window=512)  # tokenizer and prompt
    config = Gemma3TextConfig.from_pretrained(directory)
    for name, value in dict(
        hidden_size=640,
        intermediate_size=2048,
        num_hidden_layers=18,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        max_position_embeddings=32768,
        sliding_window=512,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3,
    ).items():
        setattr(config, name, value)
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def _request(k: int, new_tokens: int, n: int, words: int):
    from openbook.v1 import common_pb2, generator_pb2

    passages = [
        common_pb2.Passage(
            id=f"p{n}-{i}",
            title=f"Record {i}",
            text=" ".join(WORDS[(n + i + j) % len(WORDS)] for j in range(words)),
            score=0.0,
        )
        for i in range(k)
    ]
    return generator_pb2.GenerateRequest(
        question=f"What did the council measure in year {n}?",
        passages=passages,
        options=generator_pb2.DecodingOptions(max_new_tokens=new_tokens, min_new_tokens=new_tokens),
    )


def _gauge(metrics_port: int) -> float | None:
    import httpx

    try:
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2).text
    except httpx.HTTPError:
        return None
    found = GAUGE.search(text)
    return float(found.group(1)) if found else None


def _retry_after(exc) -> float:
    for key, value in exc.trailing_metadata() or ():
        if key == "retry-after":
            try:
                return max(0.1, float(value))
            except ValueError:
                break
    return 1.0


def _phase(stub, args: argparse.Namespace, metrics_port: int, hog: bool) -> dict:
    """``args.clients`` clients for ``args.seconds``; what they got."""
    import grpc

    from openbook_testkit.hog import CpuHog

    stop = threading.Event()
    answers: list[int] = []  # tokens of each answer
    errors: Counter[str] = Counter()
    seen: Counter[int] = Counter()
    lock = threading.Lock()

    def client(c: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            try:
                request = _request(args.k, args.new_tokens, 1000 * c + n, args.words)
                reply = stub.Generate(request, timeout=60)
            except grpc.RpcError as exc:
                with lock:
                    errors[exc.code().name] += 1
                # as a client should: wait what a 429 says, a second after anything else (a
                # loop of refusals would be a CPU load of its own on the machine measured)
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    stop.wait(min(5.0, _retry_after(exc)))
                else:
                    stop.wait(1.0)
                continue
            if not stop.is_set():
                with lock:
                    answers.append(reply.hypotheses[0].num_tokens)

    neighbour = CpuHog(1 if hog else 0)
    neighbour.start()
    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(args.clients)]
    try:
        for t in threads:
            t.start()
        while time.perf_counter() - started < args.seconds:
            size = _gauge(metrics_port)
            if size is not None:
                seen[int(size)] += 1
            time.sleep(0.5)
        stop.set()
        seconds = time.perf_counter() - started
        with lock:
            done, tokens, failed = len(answers), sum(answers), dict(errors)
    finally:
        stop.set()
        neighbour.stop()
        for t in threads:
            t.join(90)
    return {
        "answers": done,
        "answers_per_s": done / seconds,
        "tokens_per_s": tokens / seconds,
        "errors": failed,
        "threads_seen": dict(sorted(seen.items())),
    }


def _warm_up(stub, args: argparse.Namespace) -> None:
    """Unmeasured requests until the service answers the measured kind: small ones first, so
    that a speed calibrated while the machine was busier (which refuses the measured kind as
    too large, 413) is corrected by work it does admit."""
    import grpc

    end = time.monotonic() + 180
    answered = 0
    n = 0
    while answered < args.clients:
        n += 1
        k, new_tokens = (1, 4) if n % 2 else (args.k, args.new_tokens)
        try:
            stub.Generate(_request(k, new_tokens, n, args.words), timeout=120)
            answered += k == args.k
        except grpc.RpcError as exc:
            if time.monotonic() > end:
                raise RuntimeError(f"the service never answered the measured kind: {exc}") from None
            time.sleep(0.5)


def run(args: argparse.Namespace) -> dict:
    import grpc

    from openbook.v1 import generator_pb2, generator_pb2_grpc
    from openbook_testkit.stack import stop_process

    model = args.model if args.model.is_dir() else shaped_model(args.shaped_model)
    if not args.words:
        args.words = 100 if model == args.model else 30
    work = Path(tempfile.mkdtemp(prefix="openbook-threads-"))
    rport = _free_port()
    redis = subprocess.Popen(
        [shutil.which("redis-server") or "redis-server", "--port", str(rport)]
        + ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(work)],
        stdout=subprocess.DEVNULL,
    )
    results: dict = {
        "model": str(model),
        "dtype": args.dtype,
        "cpus": sorted(os.sched_getaffinity(0)),
        "clients": args.clients,
        "seconds": args.seconds,
        "k": args.k,
        "new_tokens": args.new_tokens,
        "words_per_passage": args.words,
        "load_average_at_start": os.getloadavg(),
        "rows": [],
    }
    try:
        for label, setting in MODES:
            port, metrics_port = _free_port(), _free_port()
            env = {k: v for k, v in os.environ.items() if not k.startswith("OPENBOOK_")}
            env.pop("OMP_NUM_THREADS", None)
            env.update(
                OPENBOOK_GENERATOR_MODEL=str(model),
                OPENBOOK_GENERATOR_ADAPTER="",
                OPENBOOK_GENERATOR_DTYPE=args.dtype,
                OPENBOOK_GENERATOR_PORT=str(port),
                OPENBOOK_GENERATOR_METRICS_PORT=str(metrics_port),
                OPENBOOK_GENERATOR_LOAD_LATEST_CHECKPOINT="false",
                OPENBOOK_CHECKPOINT_DIR=str(work / "checkpoints"),
                OPENBOOK_REDIS_URL=f"redis://127.0.0.1:{rport}/0",
                OPENBOOK_ACCESS_LOG="false",
                OPENBOOK_COMPUTE_THREADS=setting,
            )
            log_path = work / f"generator-{setting}.log"
            with log_path.open("w") as log:
                service = subprocess.Popen(
                    [sys.executable, "-m", "openbook_generator"], env=env, stdout=log, stderr=log
                )
                channel = grpc.insecure_channel(f"127.0.0.1:{port}")
                try:
                    stub = generator_pb2_grpc.GeneratorStub(channel)
                    end = time.monotonic() + 600
                    while True:
                        if service.poll() is not None or time.monotonic() > end:
                            raise RuntimeError(log_path.read_text()[-3000:])
                        try:
                            stub.Info(generator_pb2.InfoRequest(), timeout=2)
                            break
                        except grpc.RpcError:
                            time.sleep(1)
                    _warm_up(stub, args)
                    for hog in (False, True):
                        row = {"mode": label, "hog": hog, **_phase(stub, args, metrics_port, hog)}
                        results["rows"].append(row)
                        print(json.dumps(row), flush=True)
                        time.sleep(2)  # the hog's core settles back
                finally:
                    channel.close()
                    stop_process(service)
    finally:
        redis.terminate()
        redis.wait(10)
    reference = next(r for r in results["rows"] if r["mode"] == "fixed 2" and not r["hog"])
    for row in results["rows"]:
        base = reference["tokens_per_s"] or float("nan")
        row["ratio"] = row["tokens_per_s"] / base
    return results


def table(results: dict) -> str:
    lines = [
        "| threads | neighbour on 1 core | answers/s | tokens/s | vs quiet fixed 2 | errors "
        "| threads seen (samples) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        seen = ", ".join(f"{k}: {v}" for k, v in r["threads_seen"].items()) or "-"
        errors = ", ".join(f"{k} {v}" for k, v in r["errors"].items()) or "0"
        lines.append(
            f"| {r['mode']} | {'yes' if r['hog'] else 'no'} | {r['answers_per_s']:.2f} "
            f"| {r['tokens_per_s']:.1f} | {r['ratio']:.2f} | {errors} | {seen} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, default=Path("var/models/gemma-3-270m"))
    ap.add_argument("--shaped-model", type=Path, default=Path("var/bench/threads-model"))
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument(
        "--words",
        type=int,
        default=0,
        help="words per passage (0: 100 for --model, 30 for the "
        "shaped model, whose 300-token vocabulary spends ~4 tokens where Gemma's spends 1.3)",
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    # a stopped benchmark stops its service, redis and hog too (the finally blocks)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results = run(args)
    print(table(results))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
