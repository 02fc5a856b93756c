"""Index hot-swap (paper §4.5): who holds an office, asked against a 2016 and a 2018 index.

Runs against a live system: the index is changed with ``POST /admin/swap-index`` between the
two passes, never by restarting. Accuracy is exact match (SQuAD normalisation) with the
office holder of each year.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from tqdm import tqdm

from openbook_trainer.evaluation.metrics import exact_match

PAPER = {
    ("2016", "2016"): 70.0,
    ("2018", "2018"): 68.0,
    ("2016", "2018"): 12.0,
    ("2018", "2016"): 4.0,
}


@dataclass
class HotSwapResult:
    indexes: dict[str, str]  # year -> index name
    accuracy: dict[tuple[str, str], float] = field(
        default_factory=dict
    )  # (index year, answer year)
    predictions: list[dict] = field(default_factory=list)
    questions: int = 0


def _post(client: httpx.Client, path: str, body: dict, headers: dict | None = None) -> dict:
    reply = client.post(path, json=body, headers=headers)
    if reply.status_code != 200:
        raise RuntimeError(f"{path}: HTTP {reply.status_code}: {reply.text[:500]}")
    return reply.json()


def run_hot_swap(
    url: str,
    admin_token: str,
    questions_path: Path,
    indexes: dict[str, str] | None = None,
    k: int = 5,
    decoding: str = "rag-token",
    limit: int | None = None,
    timeout_s: float = 300.0,
) -> HotSwapResult:
    indexes = indexes or {"2016": "wiki-2016", "2018": "wiki-2018"}
    questions = [json.loads(line) for line in Path(questions_path).read_text().splitlines() if line]
    questions = questions[:limit] if limit else questions
    result = HotSwapResult(indexes=indexes, questions=len(questions))
    auth = {"Authorization": f"Bearer {admin_token}"}
    with httpx.Client(base_url=url.rstrip("/"), timeout=timeout_s) as client:
        for year, index in indexes.items():
            swapped = _post(client, "/admin/swap-index", {"index": index}, auth)
            assert swapped["active"] == index
            hits = {answer_year: 0.0 for answer_year in indexes}
            for q in tqdm(questions, desc=f"index {index}", unit="q"):
                answer = _post(
                    client,
                    "/answer",
                    {"question": q["question"], "k": k, "decoding": decoding, "use_cache": False},
                )
                if answer["index"] != index:
                    raise RuntimeError(f"answer labelled {answer['index']!r}, expected {index!r}")
                row = {"index": index, "question": q["question"], "answer": answer["answer"]}
                for answer_year in indexes:
                    correct = exact_match(answer["answer"], [q[f"answer_{answer_year}"]])
                    hits[answer_year] += correct
                    row[f"correct_{answer_year}"] = bool(correct)
                result.predictions.append(row)
            for answer_year, n in hits.items():
                result.accuracy[(year, answer_year)] = 100.0 * n / max(len(questions), 1)
    return result


def markdown(result: HotSwapResult) -> str:
    years = list(result.indexes)
    lines = [
        f"Accuracy (exact match, %) on {result.questions} leader questions; rows: the index "
        "served, columns: whose answer counts as correct. Paper (Lewis et al. 2020, §4.5) in "
        "brackets.",
        "",
        "| index | " + " | ".join(f"{y} leaders" for y in years) + " |",
        "|---|" + "---|" * len(years),
    ]
    for year in years:
        cells = []
        for answer_year in years:
            ours = result.accuracy[(year, answer_year)]
            paper = PAPER.get((year, answer_year))
            cells.append(f"{ours:.1f}" + (f" ({paper:.0f})" if paper is not None else ""))
        lines.append(f"| {result.indexes[year]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
