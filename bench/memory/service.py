"""Generator service memory under mixes of requests: resident memory before, at peak and after.

Starts the generator as users run it (``python -m openbook_generator``, the entry point compose
runs, with the default settings unless given), then sends it one kind of work after another over
gRPC: a default question, k=100, k=100 streamed, 16 beams, RAG-Sequence thorough, and crowds of
32 clients mixing them. Before each kind the kernel's peak-RSS mark of the service is reset
(``/proc/<pid>/clear_refs``); after it, once the service has been idle a moment, the peak
(``VmHWM``) and what stays resident (``VmRSS``) are read. The bound checked is

    peak RSS <= loaded RSS + OPENBOOK_GENERATOR_MEMORY_MB + passage cache + overhead

where ``loaded`` is the idle service before its first request (weights, libraries, the shared
prompt prefix) and ``overhead`` is what the run measured above budget and passage cache (printed;
docs/serving.md states the bound). Every kind's passages are new to the service (different rows
of the index), so the passage cache fills as it would over a day of questions.

    .venv/bin/python bench/memory/service.py                     # the default model from ./var
    .venv/bin/python bench/memory/service.py --dtype float32 --env MALLOC_ARENA_MAX=2
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from bench.generator.serving import generator_process

ROOT = Path(__file__).resolve().parents[2]

QUESTION = "peru"
IDLE_S = 3.0  # idle time before "after" is read: the service gives memory back when idle


@dataclass(frozen=True)
class Kind:
    """One request kind: k passages, beams, mode, new tokens, streamed or not."""

    name: str
    k: int
    beams: int = 1
    mode: str = "rag-token"
    new_tokens: int = 32
    stream: bool = False


DEFAULT = Kind("default k=5", 5)
K100 = Kind("k=100, 64 new", 100, new_tokens=64)
K100_STREAM = Kind("k=100 streamed", 100, new_tokens=64, stream=True)
K60 = Kind("k=60", 60)
K60_STREAM = Kind("k=60 streamed", 60, stream=True)
BEAMS16 = Kind("k=5 x 16 beams", 5, beams=16)
THOROUGH = Kind("k=5 x 16 beams thorough", 5, beams=16, mode="rag-sequence-thorough")
K20_THOROUGH = Kind("k=20 x 4 beams thorough", 20, beams=4, mode="rag-sequence-thorough")
K20 = Kind("k=20", 20)
K20_STREAM = Kind("k=20 streamed", 20, stream=True)
# (label, kinds sent at once: one client each)
MIXES: list[tuple[str, list[Kind]]] = [
    ("default", [DEFAULT]),
    ("k=100", [K100]),
    ("k=100 streamed", [K100_STREAM]),
    ("k=60", [K60]),
    ("k=60 streamed", [K60_STREAM]),
    ("16 beams", [BEAMS16]),
    ("16 beams thorough", [THOROUGH]),
    ("k=20 x 4 beams thorough", [K20_THOROUGH]),
    ("8 clients k=20", [K20] * 8),
    ("32 clients, default", [DEFAULT] * 32),
    (
        "32 clients, mixed",
        [DEFAULT] * 16
        + [K20_STREAM] * 6
        + [K20] * 4
        + [K60, K60_STREAM]
        + [BEAMS16] * 2
        + [THOROUGH, K20_THOROUGH],
    ),
    ("k=60 again", [K60]),
]


def _status(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


class Passages:
    """Rows of the index's passage store, handed out without repeats."""

    def __init__(self, index: Path) -> None:
        with sqlite3.connect(index / "passages.sqlite") as con:
            self.rows = con.execute("select id, title, text from passages limit 20000").fetchall()
        self.at = 0
        self.lock = threading.Lock()

    def take(self, k: int):
        from openbook.v1 import common_pb2

        with self.lock:
            rows = self.rows[self.at : self.at + k]
            self.at = (self.at + k) % (len(self.rows) - k)
        return [
            common_pb2.Passage(id=str(i), title=t, text=x, score=-0.1 * j)
            for j, (i, t, x) in enumerate(rows)
        ]


def _send(stub, passages: Passages, kind: Kind) -> tuple[str, str]:
    """One request of ``kind``; returns its outcome ("ok" or the gRPC status name) and, for a
    refusal, the service's reason."""
    import grpc

    from openbook.v1 import generator_pb2

    request = generator_pb2.GenerateRequest(
        question=QUESTION,
        passages=passages.take(kind.k),
        options=generator_pb2.DecodingOptions(
            mode=kind.mode, num_beams=kind.beams, max_new_tokens=kind.new_tokens
        ),
    )
    try:
        if kind.stream:
            for _ in stub.GenerateStream(request, timeout=600):
                pass
        else:
            stub.Generate(request, timeout=600)
        return "ok", ""
    except grpc.RpcError as exc:
        return exc.code().name, exc.details() or ""


def _client(stub, passages: Passages, kind: Kind, outcomes: list[tuple[str, str]]) -> None:
    outcomes.append(_send(stub, passages, kind))


def run(args: argparse.Namespace) -> dict:
    from openbook_generator.settings import GeneratorSettings

    settings = GeneratorSettings()
    memory_mb = args.memory_mb or settings.memory_mb
    passage_cache_mb = settings.passage_cache_mb
    results: dict = {"memory_mb": memory_mb, "passage_cache_mb": passage_cache_mb, "mixes": []}
    service_settings = {
        "OPENBOOK_GENERATOR_DTYPE": args.dtype,
        "OPENBOOK_GENERATOR_MEMORY_MB": str(memory_mb),
    }
    with generator_process(
        args.model, args.adapter, service_settings, args.env, "openbook-memory-"
    ) as service:
        stub = service.stub
        passages = Passages(args.index)
        time.sleep(IDLE_S)
        loaded = _status(service.pid, "VmRSS")
        results["loaded_mib"] = loaded / 2**20
        print(f"loaded: {loaded / 2**20:,.0f} MiB resident", flush=True)
        for label, kinds in MIXES:
            if args.only and label not in args.only:
                continue
            before = _status(service.pid, "VmRSS")
            Path(f"/proc/{service.pid}/clear_refs").write_text("5")
            started = time.perf_counter()
            outcomes: list[tuple[str, str]] = []
            threads = [
                threading.Thread(target=_client, args=(stub, passages, kind, outcomes))
                for kind in kinds
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            seconds = time.perf_counter() - started
            peak = _status(service.pid, "VmHWM")
            time.sleep(IDLE_S)
            after = _status(service.pid, "VmRSS")
            row = {
                "mix": label,
                "before_mib": round(before / 2**20),
                "peak_mib": round(peak / 2**20),
                "after_mib": round(after / 2**20),
                "peak_over_loaded_mib": round((peak - loaded) / 2**20),
                "outcomes": dict(sorted(Counter(code for code, _ in outcomes).items())),
                "seconds": round(seconds, 1),
                # why each refused request was refused (the first of each kind of refusal)
                "refusals": {code: why for code, why in reversed(outcomes) if code != "ok"},
            }
            results["mixes"].append(row)
            print(json.dumps(row), flush=True)
    worst = max(r["peak_over_loaded_mib"] for r in results["mixes"])
    results["overhead_mib"] = round(worst - memory_mb - passage_cache_mb)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, default=Path("var/models/gemma-3-270m"))
    ap.add_argument("--adapter", type=Path, default=Path("var/models/gemma-3-270m-squad-lora"))
    ap.add_argument("--index", type=Path, default=Path("var/indexes/wiki-2018"))
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--memory-mb", type=int, default=0, help="default: the service's")
    ap.add_argument("--env", nargs="*", default=[], help="NAME=VALUE for the service")
    ap.add_argument("--only", nargs="*", default=[], help="only the mixes of these labels")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    results = run(args)
    print(json.dumps({k: v for k, v in results.items() if k != "mixes"}))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
