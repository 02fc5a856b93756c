"""What reading the conversation buys a follow-up: recall@k of the second turn of two-turn
conversations, retrieved with the question the gateway builds from the history
(``openbook_gateway.conversation.contextual_question``) against the question alone.

The conversations (``conversations.jsonl`` beside this file) are written from the demo data:
``follow-up`` ones, whose second turn means nothing alone ("Who is the President of Peru?",
"Martín Vizcarra", "Who did he succeed?"), and ``topic-shift`` ones, whose second turn is
self-contained and about something else: the cost of always expanding. The first turn's answer
is the true one, as a chat front end would hold the model's answer. A passage is relevant when
its title is one of the conversation's ``titles`` and its text holds one of its ``answers``
(the answer-bearing passages of the right article).

Two ways to run it, in one command each:

* retrieval only, in process, on a demo index (every view it has, the served query encoder
  adapter where it fits, as the default stack searches)::

      .venv/bin/python bench/conversation/run.py --index var/indexes/wiki-2018 \\
          [--prepare] [--query-encoder-adapter data/adapters/minilm-squad-query] [--json out]

  ``--prepare`` builds the index first when it is missing (``openbook demo prepare``'s build
  of ``wiki-2018``: MiniLM + BM25 + the fitted fusion; minutes on a few CPU cores).

* the whole stack, through a running gateway's ``/answer`` (with ``history`` against
  without): recall@k of the passages the answer used, and Exact Match of the answer::

      .venv/bin/python bench/conversation/run.py --gateway http://localhost:8000 [--json out]

Reported per kind of conversation and mode: the share of conversations with a relevant passage
in the top k (with history, without), its 95% Wilson interval, and how many conversations each
way wins; with ``--gateway``, EM too.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from openbook.index.request import SearchRequest
from openbook_gateway.conversation import Turn, contextual_question

HERE = Path(__file__).resolve().parent
KINDS = ("follow-up", "topic-shift")


def read_conversations(path: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for row in rows:
        *earlier, last = row["turns"]
        if last["role"] != "user" or row["kind"] not in KINDS:
            raise ValueError(f"{path}: conversation {row['id']!r}: ends with no question")
    return rows


def split(row: dict[str, Any]) -> tuple[str, list[Turn]]:
    """The conversation's last question, and the turns before it."""
    *earlier, last = row["turns"]
    return last["content"], [Turn(t["role"], t["content"]) for t in earlier]


def relevant(row: dict[str, Any], title: str, text: str) -> bool:
    folded = text.casefold()
    return title in row["titles"] and any(a.casefold() in folded for a in row["answers"])


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion ``hits / n``."""
    if n == 0:
        return 0.0, 0.0
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def summarise(rows: list[dict[str, Any]], with_hits: list[bool], alone_hits: list[bool]) -> dict:
    """Per kind: recall with history and alone, intervals, and paired wins."""
    out: dict[str, Any] = {}
    for kind in KINDS:
        at = [i for i, row in enumerate(rows) if row["kind"] == kind]
        if not at:
            continue
        n = len(at)
        w = sum(with_hits[i] for i in at)
        a = sum(alone_hits[i] for i in at)
        out[kind] = {
            "n": n,
            "recall_with_history": w / n,
            "recall_with_history_95": wilson(w, n),
            "recall_alone": a / n,
            "recall_alone_95": wilson(a, n),
            "history_wins": sum(with_hits[i] and not alone_hits[i] for i in at),
            "history_loses": sum(alone_hits[i] and not with_hits[i] for i in at),
        }
    return out


def run_index(args: argparse.Namespace, rows: list[dict[str, Any]]) -> dict[str, Any]:
    # why: faiss and the encoders load only for this mode, not for --gateway
    from openbook.index import open_index
    from openbook.index.encoders import load_adapted_encoder

    if args.prepare and not (args.index / "manifest.json").exists():
        # why: the trainer's demo builder, only when asked to build the index
        from openbook_trainer.demo.indexes import prepare_demo_indexes

        prepare_demo_indexes(args.index.parent, args.data, names=[args.index.name])
    index = open_index(args.index)
    encoder = None
    adapter = args.query_encoder_adapter
    if adapter is not None and adapter.is_dir() and index.dense:
        try:
            encoder = load_adapted_encoder(adapter)
            index.check_encoder(encoder)
        except ValueError as exc:  # it does not fit this index: its own encoder, as served
            print(f"query encoder adapter {adapter} not used: {exc}")
            encoder = None
    modes = [m for m in ("dense", "bm25", "hybrid") if m in index_modes(index)]
    questions = [split(row) for row in rows]
    asked = [contextual_question(q, history) for q, history in questions]
    alone = [q for q, _ in questions]
    results: dict[str, Any] = {}
    for mode in modes:
        hits = {}
        for name, queries in (("with", asked), ("alone", alone)):
            found = index.search(SearchRequest(queries, k=args.k, retrieval=mode), encoder=encoder)
            hits[name] = [
                any(relevant(row, p.title, p.text) for p in passages)
                for row, passages in zip(rows, found, strict=True)
            ]
        results[mode] = summarise(rows, hits["with"], hits["alone"])
        results[mode]["per_conversation"] = {
            row["id"]: {"with": w, "alone": a}
            for row, w, a in zip(rows, hits["with"], hits["alone"], strict=True)
        }
    return {
        "index": str(args.index),
        "index_count": index.manifest.count,
        "default_retrieval": index.default_retrieval,
        "query_encoder": str(adapter) if encoder is not None else "the index's own",
        "modes": results,
    }


def index_modes(index: Any) -> Sequence[str]:
    views = set(index.views)
    modes = [m for m in ("dense", "bm25") if m in views]
    if {"dense", "bm25"} <= views and index.manifest.fusion is not None:
        modes.append("hybrid")
    return modes


def run_gateway(args: argparse.Namespace, rows: list[dict[str, Any]]) -> dict[str, Any]:
    # why: the HTTP client and the trainer's metrics only for this mode
    import httpx

    from openbook_trainer.evaluation.metrics import exact_match

    hits: dict[str, list[bool]] = {"with": [], "alone": []}
    em: dict[str, list[float]] = {"with": [], "alone": []}
    used: list[str] = []
    with httpx.Client(base_url=args.gateway, timeout=120) as client:
        for row in rows:
            question, history = split(row)
            for name in ("with", "alone"):
                body: dict[str, Any] = {"question": question, "k": args.k, "use_cache": False}
                if name == "with":
                    body["history"] = [{"role": t.role, "content": t.text} for t in history]
                reply = client.post("/answer", json=body)
                reply.raise_for_status()
                answer = reply.json()
                if name == "with":
                    used.append(answer["question_used"])
                hits[name].append(
                    any(relevant(row, p["title"], p["text"]) for p in answer["passages"])
                )
                em[name].append(exact_match(answer["answer"], row["answers"]))
    summary = summarise(rows, hits["with"], hits["alone"])
    for kind, stats in summary.items():
        at = [i for i, row in enumerate(rows) if row["kind"] == kind]
        stats["em_with_history"] = sum(em["with"][i] for i in at) / len(at)
        stats["em_alone"] = sum(em["alone"][i] for i in at) / len(at)
    return {"gateway": args.gateway, "summary": summary, "questions_used": used}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=Path, default=HERE / "conversations.jsonl")
    ap.add_argument("--index", type=Path, default=Path("var/indexes/wiki-2018"))
    ap.add_argument("--data", type=Path, default=Path("data"))
    ap.add_argument("--prepare", action="store_true", help="build --index if it is missing")
    ap.add_argument(
        "--query-encoder-adapter", type=Path, default=Path("data/adapters/minilm-squad-query")
    )
    ap.add_argument("--gateway", default=None, help="a running gateway's URL: the whole stack")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    rows = read_conversations(args.conversations)
    report: dict[str, Any] = {
        "conversations": str(args.conversations),
        "k": args.k,
        "machine": platform.processor() or platform.machine(),
    }
    if args.gateway:
        report.update(run_gateway(args, rows))
        tables = {"stack": report["summary"]}
    else:
        report.update(run_index(args, rows))
        tables = report["modes"]
    for mode, summary in tables.items():
        for kind in KINDS:
            if kind not in summary:
                continue
            s = summary[kind]
            lo_w, hi_w = s["recall_with_history_95"]
            lo_a, hi_a = s["recall_alone_95"]
            line = (
                f"{mode:7s} {kind:11s} n={s['n']:2d}  recall@{args.k} with history "
                f"{s['recall_with_history']:.2f} [{lo_w:.2f}, {hi_w:.2f}]  alone "
                f"{s['recall_alone']:.2f} [{lo_a:.2f}, {hi_a:.2f}]  "
                f"wins {s['history_wins']} / loses {s['history_loses']}"
            )
            if "em_with_history" in s:
                line += f"  EM {s['em_with_history']:.2f} vs {s['em_alone']:.2f}"
            print(line)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
