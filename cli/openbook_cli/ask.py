"""``openbook ask``: one question to a running system, shown with its provenance."""

from __future__ import annotations

import httpx
from rich.console import Console
from rich.table import Table


def ask(
    url: str,
    question: str,
    k: int,
    decoding: str,
    num_beams: int,
    timeout_s: float,
    retrieval: str | None = None,
) -> dict:
    """``POST /answer``; ``retrieval`` None: the index's default mode."""
    body = {"question": question, "k": k, "decoding": decoding, "num_beams": num_beams}
    if retrieval is not None:
        body["retrieval"] = retrieval
    reply = httpx.post(f"{url.rstrip('/')}/answer", json=body, timeout=timeout_s)
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
    console.print(f"[bold]{answer['answer'] or '(empty answer)'}[/bold]")
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
