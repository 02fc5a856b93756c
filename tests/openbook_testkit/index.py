"""Small builders for tests (ours and the lead's end-to-end tests). Nothing here downloads."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from openbook.index.request import SearchRequest

# Thirty one-fact passages; each QUESTIONS entry is answered by the passage with the same id.
FACTS: list[tuple[str, str, str]] = [
    (
        "p00",
        "Eiffel Tower",
        "The Eiffel Tower is a wrought-iron lattice tower in Paris, France, "
        "completed in 1889 for the World's Fair.",
    ),
    (
        "p01",
        "Mount Everest",
        "Mount Everest is Earth's highest mountain above sea level, located "
        "in the Himalayas on the border of Nepal and China.",
    ),
    (
        "p02",
        "Photosynthesis",
        "Photosynthesis is the process by which green plants use sunlight, "
        "water and carbon dioxide to produce glucose and oxygen.",
    ),
    (
        "p03",
        "Python (programming language)",
        "Python is a high-level programming language "
        "created by Guido van Rossum and first released in 1991.",
    ),
    (
        "p04",
        "Amazon River",
        "The Amazon River in South America is the largest river by discharge "
        "volume of water in the world.",
    ),
    (
        "p05",
        "Albert Einstein",
        "Albert Einstein was a theoretical physicist who developed the "
        "theory of relativity and won the 1921 Nobel Prize in Physics.",
    ),
    (
        "p06",
        "Great Wall of China",
        "The Great Wall of China is a series of fortifications built "
        "across northern China to protect against nomadic invasions.",
    ),
    (
        "p07",
        "Honey bee",
        "Honey bees live in colonies with a single queen and produce honey "
        "from the nectar of flowers.",
    ),
    (
        "p08",
        "Moon landing",
        "Apollo 11 landed the first humans on the Moon in July 1969; Neil "
        "Armstrong was the first to step onto the lunar surface.",
    ),
    (
        "p09",
        "Chess",
        "Chess is a two-player strategy board game played on a checkered board "
        "with sixty-four squares.",
    ),
    (
        "p10",
        "Coffee",
        "Coffee is a brewed drink prepared from roasted coffee beans, the seeds "
        "of berries from Coffea plants.",
    ),
    (
        "p11",
        "Tokyo",
        "Tokyo is the capital city of Japan and one of the most populous "
        "metropolitan areas in the world.",
    ),
    (
        "p12",
        "Blue whale",
        "The blue whale is a marine mammal and the largest animal known to have ever existed.",
    ),
    (
        "p13",
        "Leonardo da Vinci",
        "Leonardo da Vinci was an Italian Renaissance polymath who painted the Mona Lisa.",
    ),
    (
        "p14",
        "Volcano",
        "A volcano is a rupture in the crust of a planet that allows hot lava, "
        "volcanic ash and gases to escape from a magma chamber.",
    ),
    (
        "p15",
        "Olympic Games",
        "The modern Olympic Games are an international sporting event held "
        "every four years, first staged in Athens in 1896.",
    ),
    (
        "p16",
        "DNA",
        "DNA is a molecule composed of two chains forming a double helix that "
        "carries genetic instructions for living organisms.",
    ),
    (
        "p17",
        "Sahara",
        "The Sahara is the largest hot desert in the world, covering much of North Africa.",
    ),
    (
        "p18",
        "Penicillin",
        "Penicillin, discovered by Alexander Fleming in 1928, was one of the "
        "first antibiotics used to treat bacterial infections.",
    ),
    (
        "p19",
        "Guitar",
        "The guitar is a fretted musical instrument that usually has six strings "
        "and is played by strumming or plucking.",
    ),
    (
        "p20",
        "Jupiter",
        "Jupiter is the fifth planet from the Sun and the largest planet in the "
        "Solar System, a gas giant with a Great Red Spot.",
    ),
    (
        "p21",
        "Shakespeare",
        "William Shakespeare was an English playwright who wrote Hamlet, "
        "Macbeth and Romeo and Juliet.",
    ),
    (
        "p22",
        "Bitcoin",
        "Bitcoin is a decentralized digital currency that uses a blockchain "
        "ledger, introduced in 2009 by Satoshi Nakamoto.",
    ),
    (
        "p23",
        "Pizza",
        "Pizza is an Italian dish of flattened dough topped with tomatoes and "
        "cheese, baked in a hot oven.",
    ),
    (
        "p24",
        "Antarctica",
        "Antarctica is Earth's southernmost continent, containing the "
        "geographic South Pole and covered almost entirely by ice.",
    ),
    (
        "p25",
        "Vaccination",
        "Vaccination trains the immune system to recognise a pathogen, "
        "protecting people from infectious diseases such as measles.",
    ),
    (
        "p26",
        "Electric car",
        "Electric cars are propelled by electric motors using energy stored "
        "in rechargeable batteries instead of gasoline.",
    ),
    (
        "p27",
        "Roman Empire",
        "The Roman Empire was ruled by emperors from Rome, beginning with Augustus in 27 BC.",
    ),
    (
        "p28",
        "Tea",
        "Tea is an aromatic beverage made by pouring hot water over cured leaves of "
        "the Camellia sinensis plant.",
    ),
    (
        "p29",
        "Football",
        "Association football, or soccer, is a team sport played between two "
        "teams of eleven players with a spherical ball.",
    ),
]

QUESTIONS: dict[str, str] = {
    "p00": "When was the tower in Paris built?",
    "p01": "What is the highest mountain on Earth?",
    "p03": "Who created the Python programming language?",
    "p08": "Who was the first person to walk on the Moon?",
    "p12": "What is the largest animal that ever lived?",
    "p18": "Who discovered penicillin?",
    "p20": "What is the biggest planet in the solar system?",
    "p21": "Who wrote Hamlet?",
}


# Three plays as documents with metadata (one English, two French; their years), which the
# metadata filter tests write into a live index of either engine.
PLAYS: list[dict] = [
    {
        "id": "macbeth",
        "title": "Macbeth",
        "text": "William Shakespeare wrote Macbeth, a tragedy about a Scottish general.",
        "metadata": {"lang": "en", "year": 1606},
    },
    {
        "id": "phedre",
        "title": "Phedre",
        "text": "Jean Racine wrote Phedre, a tragedy first performed in Paris.",
        "metadata": {"lang": "fr", "year": 1677},
    },
    {
        "id": "cid",
        "title": "Le Cid",
        "text": "Pierre Corneille wrote Le Cid, a tragicomedy.",
        "metadata": {"lang": "fr", "year": 1637},
    },
]


def fact_rows() -> list[dict[str, str]]:
    return [{"id": i, "title": t, "text": x} for i, t, x in FACTS]


def write_jsonl(path: Path, rows: Iterable[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def write_facts(path: Path) -> Path:
    """The 30-passage fact corpus as JSONL."""
    return write_jsonl(path, fact_rows())


def write_dpr_tsv(path: Path, rows: Iterable[dict]) -> Path:
    """Rows of {"id","title","text"} in DPR's psgs_w100.tsv layout (id, text, title)."""
    import csv

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f, delimiter="\t", lineterminator="\n")
        w.writerow(["id", "text", "title"])
        for r in rows:
            w.writerow([r["id"], r["text"], r["title"]])
    return path


def random_rows(n: int, words: int = 20, seed: int = 0) -> list[dict[str, str]]:
    """``n`` passages of random words from a small vocabulary (for size/resume tests)."""
    rng = np.random.default_rng(seed)
    vocab = [f"w{i}" for i in range(500)]
    return [
        {"id": f"r{i}", "title": f"T{i}", "text": " ".join(rng.choice(vocab, words))}
        for i in range(n)
    ]


def word_rows(n: int, seed: int = 0, min_words: int = 3, max_words: int = 40) -> list[dict]:
    """``n`` passages of varied length made of words the tiny encoders' vocab knows (so, unlike
    ``random_rows``, every passage gets a vector of its own from ``make_tiny_dpr_encoders``)."""
    rng = np.random.default_rng(seed)
    words = _WORDS.split(" ")
    rows = []
    for i in range(n):
        length = int(rng.integers(min_words, max_words + 1))
        rows.append(
            {
                "id": f"w{i}",
                "title": str(rng.choice(words)),
                "text": " ".join(rng.choice(words, length)),
            }
        )
    return rows


_WORDS = (
    "the a an of in on is was who what when where which how to and or by for with from at "
    "tower paris mountain highest earth python language created moon first person walk "
    "largest animal planet wrote hamlet discovered penicillin river water capital city "
    "japan france china music game board tea coffee sun solar system"
)
_VOCAB = (
    ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    + _WORDS.split(" ")
    + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    + [str(d) for d in range(10)]
    + list(".,?'-();:!")
)


def write_vocab(path: Path) -> Path:
    """A tiny WordPiece vocab.txt (unique entries) good enough for random tiny BERTs."""
    seen: dict[str, None] = dict.fromkeys(_VOCAB)
    Path(path).write_text("\n".join(seen) + "\n", encoding="utf-8")
    return Path(path)


def make_tiny_dpr_encoders(
    out_dir: Path, *, hidden_size: int = 32, projection_dim: int = 0, seed: int = 0
) -> tuple[Path, Path]:
    """Write random tiny DPRContextEncoder and DPRQuestionEncoder dirs (HF format).

    Returns ``(context_dir, question_dir)``. Vectors have ``projection_dim`` dims if > 0,
    else ``hidden_size``.
    """
    import torch
    from transformers import (
        BertTokenizer,
        DPRConfig,
        DPRContextEncoder,
        DPRQuestionEncoder,
    )

    out_dir = Path(out_dir)
    cfg = DPRConfig(
        vocab_size=len(dict.fromkeys(_VOCAB)),
        hidden_size=hidden_size,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=hidden_size * 2,
        max_position_embeddings=128,
        projection_dim=projection_dim,
    )
    dirs = []
    for i, (cls, sub) in enumerate(
        ((DPRContextEncoder, "ctx_encoder"), (DPRQuestionEncoder, "question_encoder"))
    ):
        torch.manual_seed(seed + i)
        d = out_dir / sub
        d.mkdir(parents=True, exist_ok=True)
        vocab = write_vocab(d / "vocab.txt")
        tok = BertTokenizer(str(vocab), do_lower_case=True, model_max_length=128)
        model = cls(cfg).eval()
        model.save_pretrained(d)
        tok.save_pretrained(d)
        dirs.append(d)
    return dirs[0], dirs[1]


def random_vectors(n: int, dim: int, seed: int = 0, normalize: bool = False) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    if normalize:
        x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x


def build_words_index(root: Path, dpr_dirs: tuple[Path, Path], n: int = 150):
    """A flat files index ``words`` under ``root`` over ``word_rows(n, seed=3)`` with the tiny
    DPR encoders of ``dpr_dirs`` (context, question): dense and BM25, opened (a LoadedIndex).
    The Milvus tests copy it into Milvus and compare both engines on it."""
    from openbook.index import build_index, open_index
    from openbook.index.spec import BuildOptions, IndexSpec

    corpus = write_jsonl(Path(root) / "corpus.jsonl", word_rows(n, seed=3))
    ctx, q = dpr_dirs
    spec = IndexSpec(name="words", index_type="flat", encoder=str(ctx), query_encoder=str(q))
    build_index([corpus], Path(root) / "words", spec, BuildOptions(progress=False))
    return open_index(Path(root) / "words")


def write_vector_index(
    out_dir: Path, vectors: np.ndarray, index_type: str = "flat", name: str = "vec", **params
) -> Path:
    """An index directory over given ``vectors`` (no encoder: search it with
    ``SearchRequest(query_vectors=...)``); passages are ``random_rows(len(vectors))``.
    ``params`` are the index's :class:`~openbook.index.spec.AnnParams` (hnsw_m, ef_search,
    nlist, pq_m, ...)."""
    from openbook.index import faiss_index
    from openbook.index.layout import PASSAGES_FILE, VECTORS_FILE
    from openbook.index.manifest import MANIFEST, Manifest, checksum_fields
    from openbook.index.spec import AnnParams
    from openbook.index.store import PassageWriter
    from openbook.types import Passage

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True)
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    n, dim = vectors.shape
    writer = PassageWriter(out_dir / PASSAGES_FILE)
    writer.add(Passage(r["id"], r["title"], r["text"]) for r in random_rows(n, words=5))
    writer.close()
    np.save(out_dir / VECTORS_FILE, vectors)
    p = faiss_index.default_params(index_type, n, dim, AnnParams(**params))
    index, p = faiss_index.build_faiss(vectors, index_type, p)
    faiss_index.write(index, out_dir / faiss_index.INDEX_FILE)
    Manifest(
        name=name,
        encoder="random-vectors",
        query_encoder="random-vectors",
        dim=dim,
        count=n,
        index_type=index_type,
        index_params=p,
        **checksum_fields(out_dir),
    ).to_file(out_dir / MANIFEST)
    return out_dir


def reply_hits(reply) -> tuple[list[list[str]], list[list[float]]]:
    """(ids, scores) per query of a RetrieveResponse."""
    return (
        [[p.id for p in r.passages] for r in reply.results],
        [[p.score for p in r.passages] for r in reply.results],
    )


def searched_hits(
    servicer, index: str, queries: list[str], k: int, encoder
) -> tuple[list[list[str]], list[list[float]]]:
    """(ids, scores) per query of searching a retriever servicer's ``index`` directly with
    ``encoder``: what a Retrieve served by that pairing must answer."""
    with servicer.registry.lease(index) as idx:
        hits = idx.search(SearchRequest(queries, k=k), encoder=encoder)
    return [[p.id for p in ps] for ps in hits], [[p.score for p in ps] for ps in hits]


def assert_same_hits(reply, want: tuple[list[list[str]], list[list[float]]]) -> None:
    """A RetrieveResponse holds ``want``'s ids, and its scores up to float32 rounding."""
    import pytest

    ids, scores = reply_hits(reply)
    assert ids == want[0]
    for s, w in zip(scores, want[1], strict=True):
        assert s == pytest.approx(w, rel=1e-5, abs=1e-5)
