"""Streaming against non-streaming answers under load: time to first token (TTFT).

The stack ``openbook up`` starts (as bench/load/run.py), N concurrent clients (default 1 and 4)
for a fixed time per level. Every client asks each of its questions twice, back to back: once
with ``"stream": true`` (Server-Sent Events, one ``token`` event per generated token with the
default RAG-Token greedy decoding) and once as a plain JSON request, the order alternating from
one question to the next and from one client to the next, so that at any moment about half the
requests in flight stream and machine noise hits both modes alike. Everything is uncached
(``use_cache: false``) and only questions answered in both modes are counted.

Per level and mode it reports:

- TTFT (streaming only): from sending the request to the first ``token`` event with a token;
- total latency: from sending the request to the whole answer (the ``answer`` event, or the
  JSON body), p50 / p95;
- tokens/s per request (streaming only): the tokens after the first / the time from the first
  token event to the last (the rate at which an answer is written once it has begun);
- aggregate tokens/s: the generated tokens (``hypotheses[0].num_tokens``) of the level's answers
  over its wall time (in the table both modes together: each question is answered in both, with
  the same greedy answer, so the modes' own shares, in the JSON, are equal by construction);

and two ratios measured in the same run: streaming TTFT p50 / non-streaming latency p50 (how much
sooner a streaming client sees the answer begin) and streaming total p50 / non-streaming total
p50 (what streaming costs).

    .venv/bin/python bench/load/stream.py                       # tiny BART, 1 and 4 clients
    .venv/bin/python bench/load/stream.py --clients 1 2 8 --seconds 20 --json stream.json
    .venv/bin/python bench/load/stream.py --real --var var --seconds 120 --json stream-real.json

``--real`` runs the default stack (Gemma 3 270M, the demo index wiki-2018, default k and
decoding) from a ``var/`` that ``openbook demo prepare`` filled, asking the demo questions.
The generator's passage cache (keys/values of passages seen before) is off unless
``--passage-cache-mb`` says otherwise: each question is asked twice, and with it on the second
asking would skip its passages' prefill, measuring the cache instead of streaming.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from bench.load.run import (
    QUESTION_LIST,
    REAL_GENERATOR,
    REAL_INDEX,
    LocalStack,
    demo_questions,
    prepare,
    run_clients,
)
from openbook_testkit.sse import read_events

MODES = ("stream", "plain")


@dataclass
class Sample:
    """One answered request."""

    mode: str
    client: int
    pair: int  # the client's question number: both modes ask the same question
    status: str  # "200", another HTTP status, "error <status>" (an error event) or "conn"
    total_s: float = float("nan")
    ttft_s: float = float("nan")  # streaming: the first token event with a token
    decode_s: float = float("nan")  # streaming: first token event to last
    token_events: int = 0
    tokens: int = 0  # hypotheses[0].num_tokens
    prompt_tokens: int = 0
    retrieve_ms: float = float("nan")  # the gateway's own timings
    server_total_ms: float = float("nan")


@dataclass
class ModeStats:
    mode: str
    answered: int
    p50_ms: float
    p95_ms: float
    ttft_p50_ms: float | None  # streaming only
    ttft_p95_ms: float | None
    tok_s_p50: float | None  # per request, streaming only
    aggregate_tok_s: float
    mean_tokens: float
    mean_prompt_tokens: float
    retrieve_p50_ms: float
    server_total_p50_ms: float


@dataclass
class Level:
    clients: int
    seconds: float
    pairs: int  # questions answered in both modes (what the stats are over)
    errors: int
    statuses: dict[str, int]
    stream: ModeStats
    plain: ModeStats
    ttft_over_plain_p50: float  # streaming TTFT p50 / non-streaming latency p50
    stream_over_plain_p50: float  # streaming total p50 / non-streaming total p50
    stream_over_plain_p95: float
    # streamed answers with one token event per generated token (RAG-Token greedy: all)
    streams_token_per_event: int
    passage_cache: dict[str, float] = field(default_factory=dict)  # lookups during the level


def _lines(reply: http.client.HTTPResponse):
    while True:
        raw = reply.readline()
        if not raw:
            return
        yield raw.decode().rstrip("\r\n")


def _answered(sample: Sample, answer: dict) -> None:
    best = answer["hypotheses"][0] if answer.get("hypotheses") else {}
    sample.tokens = int(best.get("num_tokens") or 0)
    sample.prompt_tokens = int(answer.get("prompt_tokens") or 0)
    timings = answer.get("timings_ms") or {}
    sample.retrieve_ms = float(timings.get("retrieve_ms", float("nan")))
    sample.server_total_ms = float(timings.get("total_ms", float("nan")))


def ask(conn: http.client.HTTPConnection, body: dict, sample: Sample) -> None:
    """Send ``body`` in ``sample.mode`` on ``conn`` and fill ``sample`` with what came back."""
    stream = sample.mode == "stream"
    payload = json.dumps({**body, "stream": stream})
    started = time.perf_counter()
    conn.request("POST", "/answer", payload, {"content-type": "application/json"})
    reply = conn.getresponse()
    if reply.status != 200 or not stream:
        data = reply.read()
        sample.total_s = time.perf_counter() - started
        sample.status = str(reply.status)
        if reply.status == 200:
            _answered(sample, json.loads(data))
        return
    first = last = None
    status = "no answer event"
    for event in read_events(_lines(reply)):
        now = time.perf_counter()
        if event.event == "token":
            if event.json()["token"]:
                first = now if first is None else first
                last = now
                sample.token_events += 1
        elif event.event == "answer":
            status = "200"
            _answered(sample, event.json())
        elif event.event == "error":
            status = f"error {event.json().get('status')}"
    sample.total_s = time.perf_counter() - started
    sample.status = status
    if first is not None:
        sample.ttft_s = first - started
        sample.decode_s = last - first


def drive(port: int, clients: int, seconds: float, body) -> tuple[list[Sample], float]:
    """``clients`` threads, one keep-alive connection each (``http.client``, lean), asking
    ``body(client, pair)`` in both modes, back to back, until ``seconds`` have passed."""
    samples: list[Sample] = []
    lock = threading.Lock()
    stop_at = time.perf_counter() + seconds

    def client(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
        pair = 0
        while time.perf_counter() < stop_at:
            # Alternate which mode goes first, per question and per client.
            order = MODES if (i + pair) % 2 == 0 else MODES[::-1]
            for mode in order:
                if time.perf_counter() >= stop_at:
                    break
                sample = Sample(mode, i, pair, "conn")
                try:
                    ask(conn, body(i, pair), sample)
                except (OSError, http.client.HTTPException):
                    conn.close()
                    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
                with lock:
                    samples.append(sample)
                if sample.status == "429":
                    time.sleep(1.0)  # as Retry-After says
            pair += 1
        conn.close()

    return samples, run_clients(client, clients)


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def mode_stats(mode: str, samples: list[Sample], wall: float) -> ModeStats:
    total = [s.total_s * 1000 for s in samples]
    ttft = [s.ttft_s * 1000 for s in samples if s.ttft_s == s.ttft_s]
    rates = [(s.token_events - 1) / s.decode_s for s in samples if s.decode_s > 0]
    streaming = mode == "stream"
    return ModeStats(
        mode=mode,
        answered=len(samples),
        p50_ms=_pct(total, 50),
        p95_ms=_pct(total, 95),
        ttft_p50_ms=_pct(ttft, 50) if streaming else None,
        ttft_p95_ms=_pct(ttft, 95) if streaming else None,
        tok_s_p50=_pct(rates, 50) if streaming else None,
        aggregate_tok_s=sum(s.tokens for s in samples) / wall,
        mean_tokens=float(np.mean([s.tokens for s in samples])) if samples else float("nan"),
        mean_prompt_tokens=(
            float(np.mean([s.prompt_tokens for s in samples])) if samples else float("nan")
        ),
        retrieve_p50_ms=_pct([s.retrieve_ms for s in samples], 50),
        server_total_p50_ms=_pct([s.server_total_ms for s in samples], 50),
    )


def passage_lookups(stack: LocalStack) -> dict[str, float]:
    """The generator's passage-cache lookups so far, by result (hit / miss)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{stack.ports['gmetrics']}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "openbook_passage_cache_lookups":
                out[s.labels["result"]] = out.get(s.labels["result"], 0.0) + s.value
    return out


def run_level(stack: LocalStack, clients: int, seconds: float, body) -> tuple[Level, list[Sample]]:
    before = passage_lookups(stack)
    samples, wall = drive(stack.ports["gateway"], clients, seconds, body)
    after = passage_lookups(stack)
    statuses = Counter(s.status for s in samples)
    # Only questions answered in both modes: the same questions on both sides.
    ok: dict[tuple[int, int], dict[str, Sample]] = {}
    for s in samples:
        if s.status == "200":
            ok.setdefault((s.client, s.pair), {})[s.mode] = s
    pairs = [p for p in ok.values() if len(p) == 2]
    stream = mode_stats("stream", [p["stream"] for p in pairs], wall)
    plain = mode_stats("plain", [p["plain"] for p in pairs], wall)
    level = Level(
        clients=clients,
        seconds=round(wall, 2),
        pairs=len(pairs),
        errors=sum(n for status, n in statuses.items() if status != "200"),
        statuses=dict(statuses),
        stream=stream,
        plain=plain,
        ttft_over_plain_p50=stream.ttft_p50_ms / plain.p50_ms,
        stream_over_plain_p50=stream.p50_ms / plain.p50_ms,
        stream_over_plain_p95=stream.p95_ms / plain.p95_ms,
        streams_token_per_event=sum(p["stream"].token_events == p["stream"].tokens for p in pairs),
        passage_cache={k: after.get(k, 0.0) - before.get(k, 0.0) for k in after},
    )
    return level, samples


def table(levels: list[Level]) -> str:
    head = (
        "| clients | questions (x2) | errors | stream TTFT p50 / p95 ms "
        "| stream total p50 / p95 ms | non-stream total p50 / p95 ms "
        "| TTFT / non-stream p50 | stream / non-stream total p50 (p95) "
        "| tokens/answer | stream tok/s per request p50 | aggregate tok/s |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    rows = []
    for lv in levels:
        s, p = lv.stream, lv.plain
        rows.append(
            f"| {lv.clients} | {lv.pairs} | {lv.errors} "
            f"| {s.ttft_p50_ms:,.0f} / {s.ttft_p95_ms:,.0f} "
            f"| {s.p50_ms:,.0f} / {s.p95_ms:,.0f} | {p.p50_ms:,.0f} / {p.p95_ms:,.0f} "
            f"| **{lv.ttft_over_plain_p50:.2f}x** "
            f"| **{lv.stream_over_plain_p50:.2f}x** ({lv.stream_over_plain_p95:.2f}x) "
            f"| {s.mean_tokens:.1f} | {s.tok_s_p50:.1f} "
            f"| {s.aggregate_tok_s + p.aggregate_tok_s:.2f} |"
        )
    return head + "\n".join(rows)


def tiny_body(i: int, pair: int) -> dict:
    # As run.py's uncached load: varying questions and k, never the answer cache.
    return {
        "question": QUESTION_LIST[(i + pair) % len(QUESTION_LIST)],
        "k": 3 + (i + pair) % 3,
        "use_cache": False,
    }


def real_body(questions: list[str]):
    def body(i: int, pair: int) -> dict:
        # Each client walks the demo questions from its own offset; default k and decoding.
        return {"question": questions[(i * 97 + pair) % len(questions)], "use_cache": False}

    return body


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4], help="default: 1 4")
    ap.add_argument(
        "--seconds", type=float, default=10.0, help="per level, both modes together (default 10)"
    )
    ap.add_argument("--var", type=Path, default=None, help="tiny: reuse/prepare data here")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument(
        "--real",
        action="store_true",
        help="the default stack (Gemma 3 270M, demo index) from --var (default ./var)",
    )
    ap.add_argument(
        "--passage-cache-mb",
        type=int,
        default=0,
        help="the generator's passage cache (OPENBOOK_GENERATOR_PASSAGE_CACHE_MB; default 0:\n"
        "off, so that the second asking of a question prefills its passages too)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per service process (tiny default 1; --real: torch's own default)",
    )
    args = ap.parse_args(argv)

    env = {"OPENBOOK_GENERATOR_PASSAGE_CACHE_MB": str(args.passage_cache_mb)}
    threads = args.threads if args.threads is not None else (None if args.real else 1)
    if threads is not None:
        env |= {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}

    with tempfile.TemporaryDirectory(prefix="openbook-stream-") as tmp:
        if args.real:
            var = (args.var or Path("var")).resolve()
            if not (var / "models" / REAL_GENERATOR / "config.json").exists():
                print(f"{var}/models/{REAL_GENERATOR} is missing: run `openbook demo prepare`")
                return 2
            body = real_body(demo_questions())
            stack = LocalStack(
                var, generator=REAL_GENERATOR, default_index=REAL_INDEX, extra_env=env
            )
            what = f"default stack ({REAL_GENERATOR}, {REAL_INDEX})"
        else:
            var = args.var or Path(tmp)
            print(f"preparing indexes and a tiny BART in {var} ...", flush=True)
            prepare(var)
            body = tiny_body
            stack = LocalStack(var, extra_env=env)
            what = "tiny BART, MiniLM over two 30-passage indexes"
        print(f"starting the stack (openbook up: {what}) ...", flush=True)
        stack.start(timeout_s=600)
        levels: list[Level] = []
        samples: list[list[Sample]] = []
        try:
            for i in range(2):  # warm-up, both modes: first requests pay for lazy loading
                for mode in MODES:
                    httpx.post(
                        f"{stack.url}/answer",
                        json={**body(i, 1000), "stream": mode == "stream"},
                        timeout=300,
                    )
            for clients in args.clients:
                print(
                    f"{clients} client(s), uncached, streaming and not, {args.seconds:.0f} s ...",
                    flush=True,
                )
                level, level_samples = run_level(stack, clients, args.seconds, body)
                levels.append(level)
                samples.append(level_samples)
                print(table(levels[-1:]).splitlines()[-1], flush=True)
        finally:
            stack.stop()

    threads_text = f"{threads} torch thread(s) per service" if threads else "torch's threads"
    machine = (
        f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"{threads_text}; passage cache {args.passage_cache_mb} MB"
    )
    print()
    print(f"machine: {machine}; {what}")
    print(table(levels))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "machine": machine,
                    "stack": what,
                    "command": sys.argv,
                    "levels": [asdict(lv) for lv in levels],
                    "samples": [[asdict(s) for s in level] for level in samples],
                },
                indent=2,
            )
        )
    return 0 if all(lv.errors == 0 and lv.pairs > 0 for lv in levels) else 1


if __name__ == "__main__":
    sys.exit(main())
