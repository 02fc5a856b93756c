"""Open-domain QA on the demo SQuAD questions (question only, retrieval over all passages).

Compares, on one fixed subset: the generator alone (closed book), RAG-Token, RAG-Sequence fast
and thorough, dense vs BM25 retrieval, and exact match as k grows (paper Figure 3). Runs the
libraries in-process; each prediction is logged as it is made, so a rerun resumes.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field, replace
from pathlib import Path

from tqdm import tqdm

from openbook.index import open_index
from openbook.index.engine import RetrievalMode
from openbook.index.request import SearchRequest
from openbook.rag import DecodingOptions, RagGenerator
from openbook.types import Passage
from openbook_trainer.evaluation.metrics import answer_recall_at_k
from openbook_trainer.experiments.inputs import ExperimentInputs
from openbook_trainer.experiments.records import ResultLog, em_f1, qa_row

# A single empty passage: the generator's own prompt with nothing retrieved (closed book).
NO_PASSAGE = Passage(id="closed-book", title="", text="", score=0.0)


@dataclass(frozen=True)
class System:
    name: str
    mode: str  # decoding mode, or "closed-book"
    index: str  # "dense" | "bm25"
    k: int


@dataclass
class OpenQAConfig(ExperimentInputs):
    dense_index: str = "wiki-2018"
    bm25_index: str = "wiki-2018-bm25"
    n: int = 100
    seed: int = 0
    ks: tuple[int, ...] = (1, 3, 5, 10)
    k: int = 5
    max_new_tokens: int = 16
    # Multiplies retriever scores (already the index's score_scale x inner product) before the
    # softmax that makes the document prior p(z|x): an ablation of how peaked the prior is.
    prior_scale: float = 1.0

    def systems(self) -> list[System]:
        systems = [System("closed book", "closed-book", "dense", 0)]
        systems += [System(f"RAG-Token k={k}", "rag-token", "dense", k) for k in self.ks]
        systems += [
            System(f"RAG-Sequence fast k={self.k}", "rag-sequence-fast", "dense", self.k),
            System(f"RAG-Sequence thorough k={self.k}", "rag-sequence-thorough", "dense", self.k),
            System(f"RAG-Token BM25 k={self.k}", "rag-token", "bm25", self.k),
        ]
        return systems


@dataclass
class OpenQAResult:
    config: dict
    scores: dict[str, dict[str, float]] = field(default_factory=dict)  # system -> {em, f1}
    retrieval: dict[str, dict[int, float]] = field(default_factory=dict)  # index -> k -> recall


def select_questions(path: Path, n: int, seed: int) -> list[dict]:
    """A fixed random subset: the same ``n`` and ``seed`` always give the same questions."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line]
    rows.sort(key=lambda r: r["id"])
    return random.Random(seed).sample(rows, min(n, len(rows)))


def run_open_qa(config: OpenQAConfig, out_dir: Path) -> OpenQAResult:
    questions = select_questions(config.questions, config.n, config.seed)
    log = ResultLog(Path(out_dir) / "open_qa_predictions.jsonl")
    generator = RagGenerator.load(config.generator)
    depth = max([*config.ks, config.k])
    retrieved: dict[str, list[list[Passage]]] = {}
    score_scales: dict[str, float] = {}
    for kind, name in (("dense", config.dense_index), ("bm25", config.bm25_index)):
        with open_index(Path(config.index_root) / name, verify=False) as index:
            texts = [q["question"] for q in questions]
            retrieved[kind] = index.search(
                SearchRequest(texts, k=depth, retrieval=RetrievalMode(kind))
            )
            score_scales[kind] = index.manifest.score_scale

    result = OpenQAResult(
        config={
            **vars(config),
            "score_scales": score_scales,
            "questions_used": [q["id"] for q in questions],
        }
    )
    for kind in retrieved:
        texts = [[p.text for p in passages] for passages in retrieved[kind]]
        golds = [q["answers"] for q in questions]
        result.retrieval[kind] = {k: answer_recall_at_k(texts, golds, k) for k in config.ks}
    for system in config.systems():
        rows = []
        mode = "rag-token" if system.mode == "closed-book" else system.mode
        options = DecodingOptions(mode=mode, num_beams=1, max_new_tokens=config.max_new_tokens)
        for i, q in enumerate(tqdm(questions, desc=system.name, unit="q")):
            key = f"{system.name}|{generator.model_version}|{q['id']}"
            # the factor on inner products (index x ablation) changes the prior: keep it apart
            scale = score_scales[system.index] * config.prior_scale if system.k else 1.0
            if scale != 1.0:
                key += f"|prior x{scale:g}"
            row = log.get(key)
            if row is None:
                passages = (
                    [NO_PASSAGE]
                    if system.mode == "closed-book"
                    else [
                        replace(p, score=p.score * config.prior_scale)
                        for p in retrieved[system.index][i][: system.k]
                    ]
                )
                answer = generator.generate(q["question"], passages, options).hypotheses[0].text
                row = qa_row(q, answer)
                log.add(key, row)
            rows.append(row)
        result.scores[system.name] = em_f1(rows)
    return result


def plot_em_by_k(result: OpenQAResult, ks: tuple[int, ...], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ems = [result.scores[f"RAG-Token k={k}"]["em"] for k in ks]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(ks, ems, marker="o", label="RAG-Token EM")
    ax.plot(
        ks,
        [result.retrieval["dense"][k] for k in ks],
        marker="s",
        linestyle="--",
        label="answer in top-k (dense)",
    )
    ax.set_xlabel("retrieved passages k")
    ax.set_ylabel("%")
    ax.set_xticks(list(ks))
    ax.set_title("Open-domain SQuAD subset: EM vs k")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _prior_logits(config: dict) -> str:
    extra = config.get("prior_scale", 1.0)
    parts = []
    for kind, scale in config.get("score_scales", {}).items():
        factor = scale * extra
        what = "inner product" if kind == "dense" else "score"
        parts.append(f"{factor:g} x {kind} {what}" if factor != 1.0 else f"{kind} {what}")
    return ", ".join(parts) or "retriever scores"


def markdown(result: OpenQAResult) -> str:
    n = len(result.config["questions_used"])
    lines = [
        f"{n} SQuAD v1.1 dev questions (seed {result.config['seed']}), open-domain: question "
        f"only, retrieval over every passage of `{result.config['dense_index']}`; greedy "
        "decoding, at most "
        f"{result.config['max_new_tokens']} new tokens. Document prior: softmax over "
        f"{_prior_logits(result.config)}.",
        "",
        "| system | EM | F1 |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {s['em']:.1f} | {s['f1']:.1f} |" for name, s in result.scores.items()]
    lines += [
        "",
        "Answer found in the top-k passages (%):",
        "",
        "| retrieval | " + " | ".join(f"k={k}" for k in result.config["ks"]) + " |",
        "|---|" + "---|" * len(result.config["ks"]),
    ]
    for kind, by_k in result.retrieval.items():
        lines.append(f"| {kind} | " + " | ".join(f"{v:.1f}" for v in by_k.values()) + " |")
    return "\n".join(lines)
