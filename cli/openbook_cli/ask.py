"""``openbook ask``: one question to a running system, shown with its provenance."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from rich.console import Console
from rich.table import Table


@dataclass(frozen=True)
class AskOptions:
    """What ``openbook ask`` sends besides the question (the gateway checks each field)."""

    k: int = 5
    decoding: str = "rag-token"
    num_beams: int = 1
    retrieval: str | None = None  # None: the index's default mode
    min_confidence: float | None = None  # None: the server's default (off unless set)

    def body(self, question: str) -> dict:
        body: dict = {
            "question": question,
            "k": self.k,
            "decoding": self.decoding,
            "num_beams": self.num_beams,
        }
        if self.retrieval is not None:
            body["retrieval"] = self.retrieval
        if self.min_confidence is not None:
            body["min_confidence"] = self.min_confidence
        return body


def ask(url: str, question: str, options: AskOptions, timeout_s: float) -> dict:
    """``POST /answer`` with ``options``; the reply's body, or RuntimeError naming the status."""
    reply = httpx.post(f"{url.rstrip('/')}/answer", json=options.body(question), timeout=timeout_s)
    if reply.status_code != 200:
        try:
            detail = reply.json().get("detail")
        except ValueError:
            detail = reply.text
        raise RuntimeError(f"HTTP {reply.status_code}: {detail}")
    return reply.json()


def _bar(p: float | None, width: int = 20) -> str:
    if p is None:
        return ""
    filled = round(max(0.0, min(1.0, p)) * width)
    return "█" * filled + "·" * (width - filled) + f" {p:.2f}"


def render(answer: dict, console: Console | None = None) -> None:
    """Answer, passages with prior p(z|x) and posterior p(z|x,y), per-token posterior."""
    console = console or Console()
    if answer.get("abstained"):
        console.print(
            f"[bold]Not confident enough to answer[/bold] (confidence "
            f"{answer['confidence']:.2f} < {answer['min_confidence']:.2f}); the passages "
            "and the withheld answer follow"
        )
    else:
        console.print(f"[bold]{answer['answer'] or '(empty answer)'}[/bold]")
    if answer.get("confidence") is not None:
        console.print(f"confidence {_bar(answer['confidence'])}")
    console.print(
        f"index {answer['index']}"
        + (f" ({answer['retrieval']})" if answer.get("retrieval") else "")
        + f" · generator {answer['model_version']} · "
        f"retriever {answer['retriever_version']} · {answer['decoding']}"
        + (" · cached" if answer.get("cached") else "")
    )
    passages = Table(title="Passages", show_lines=False)
    passages.add_column("#", justify="right")
    passages.add_column("title")
    passages.add_column("score", justify="right")
    passages.add_column("prior p(z|x)")
    passages.add_column("posterior p(z|x,y)")
    for i, p in enumerate(answer["passages"], 1):
        passages.add_row(
            str(i), p["title"], f"{p['score']:.3f}", _bar(p.get("prior")), _bar(p.get("posterior"))
        )
    console.print(passages)
    best = answer["hypotheses"][0] if answer.get("hypotheses") else None
    if best and best.get("tokens"):
        tokens = Table(title="RAG-Token: p(z | x, y_1..y_i) per generated token")
        tokens.add_column("token")
        for i in range(len(answer["passages"])):
            tokens.add_column(f"z{i + 1}", justify="right")
        for t in best["tokens"]:
            top = max(t["posterior"]) if t["posterior"] else 0
            cells = [f"[bold]{p:.2f}[/bold]" if p == top else f"{p:.2f}" for p in t["posterior"]]
            tokens.add_row(repr(t["token"]), *cells)
        console.print(tokens)
    if answer.get("hypotheses") and len(answer["hypotheses"]) > 1:
        console.print("n-best:")
        for h in answer["hypotheses"]:
            console.print(f"  {h['log_prob']:8.3f}  {h['text']}")
