"""Live documents, measured (issue 32): ingestion through the API against a build, search with
a write segment against the same passages compacted, and what a compaction costs.

Three parts, each a ratio against a reference measured in the same run (so a busy neighbour
slows both sides of a ratio alike):

- **ingestion**: passages/s of ``POST /indexes/{i}/documents:batch`` (batches of ``--batch``
  documents, one at a time) on the stack ``openbook up`` starts (tests/openbook_testkit's
  LocalStack: the MiniLM fact indexes, a tiny BART), into an index created ``like`` the active
  one, against ``build_index`` (what ``openbook index build`` runs) over the same documents with
  the same encoder, in this process. Each round builds first, then ingests into a new index.
  Target: ingestion >= 80% of the build's rate. The build's time includes loading its encoder
  (~1 s, as ``openbook index build`` pays it); the API's first, uncounted, one-document batch
  loads the retriever's.
- **query latency**: p50/p99 of ``LiveIndex.search`` (dense, with the query vectors computed
  beforehand, so only the index's part is timed; and bm25) over a base of ``--base-passages``
  with a ``--segment``-passage write segment, against a copy of that live index compacted;
  the two take turns query by query. Target: segment p50 <= 1.2x compacted p50. ``--encoder
  tiny`` (the default) encodes with the test kit's tiny random DPR projecting to MiniLM's 384
  dimensions: the vectors searched have MiniLM's size, and filling a 10k segment and a large
  synthetic index takes minutes, not the hours MiniLM takes on two shared cores.
- **compaction**: seconds and peak RSS (the child process's ``ru_maxrss``, which opens the live
  index, replays its log and compacts; its RSS once open is reported too) for a synthetic live
  index of each ``--n`` one-passage documents plus ``--compact-segment`` written ones, and for
  a copy of ``--demo`` (e.g. var/indexes/wiki-2016) when that index exists. The synthetic base
  is built by the build stages from seeded random unit vectors (no encoder runs: a 1M-passage
  base is minutes, not the hours encoding it would take here); its manifest names the
  ``--encoder``, which encodes the written documents. Compaction encodes nothing
  (openbook/index/compaction.py): it reuses the base's stored vectors and the segment's.

    .venv/bin/python bench/index/documents.py [--docs 2000] [--segment 10000] [--n 100000 1000000]
        [--demo var/indexes/wiki-2016] [--json docs/bench/documents-<date>.json]
    .venv/bin/python bench/index/documents.py --smoke     # every part, tiny sizes, ~15 s

``--smoke`` (tests/test_bench_scripts.py) runs the ingestion part against the same retriever,
generator and gateway code served in this process (the test kit's in-process backends and
gateway) instead of ``openbook up``'s processes, whose start alone takes longer than the smoke
run may; it measures nothing worth reporting.

Documents are synthetic: ``--words`` words (one passage at the default 100-word split) drawn
from a fixed English vocabulary with a fixed seed, so every run encodes the same text.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import resource
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from multiprocessing import get_context
from pathlib import Path

import httpx
import numpy as np

from openbook.index import build_index
from openbook.index.documents import Document
from openbook.index.encoders import encoder_id, load_encoder
from openbook.index.live import BASE_PREFIX, LiveIndex, LiveOptions
from openbook.index.manifest import Manifest
from openbook.index.request import SearchRequest
from openbook.index.spec import BuildOptions, IndexSpec
from openbook.index.stages import BuildSource, build_lock, stage_and_publish
from openbook.index.vectors import ShardWork, VectorSource, default_score_scale
from openbook.types import Passage

INGEST_TARGET = 0.8  # ingestion passages/s >= 80% of the build's
LATENCY_TARGET = 1.2  # segment p50 <= 1.2x compacted p50
MINILM_DIM = 384
ENCODERS = ("tiny", "minilm")
PARTS = ("ingestion", "latency", "compaction")
WRITE_BATCH = 1000  # documents per put_many when filling a live index (the API's maximum)

# What synthetic documents are made of: common words of encyclopedia text.
_VOCABULARY_TEXT = (
    "the of and to in is was for on as with by at from that which city river mountain king "
    "queen war church school university music album film game team season league player "
    "company bank railway station island village county province state country capital "
    "population census century history empire army battle treaty law court election party "
    "president minister government council bridge road tower castle museum library garden "
    "species genus family plant animal bird fish insect tree flower forest lake sea ocean "
    "coast harbour ship aircraft engine car train bus language word book novel poem author "
    "painter artist singer band song record label studio television radio network station "
    "science physics chemistry biology medicine disease hospital doctor patient water fire "
    "stone iron gold silver copper coal oil gas energy power light sound colour red green "
    "blue black white north south east west old new first second third great small large"
)
_VOCABULARY = _VOCABULARY_TEXT.split()


@dataclass(frozen=True)
class Sizes:
    """How much each part measures (``--smoke`` shrinks them all)."""

    docs: int  # ingestion: documents per round
    batch: int  # ingestion: documents per API call
    rounds: int
    base_passages: int  # latency: the base under the segment
    segment: int  # latency: passages in the write segment
    queries: int
    n: tuple[int, ...]  # compaction: synthetic documents in each base
    compact_segment: int  # compaction: documents written before compacting
    words: int


def synthetic_texts(n: int, words: int, seed: int) -> Iterator[tuple[str, str]]:
    """``n`` (title, text) pairs, the text ``words`` words long, the same for the same seed."""
    rng = random.Random(seed)
    for _ in range(n):
        yield (
            " ".join(rng.choices(_VOCABULARY, k=3)).title(),
            " ".join(rng.choices(_VOCABULARY, k=words)),
        )


def synthetic_documents(n: int, words: int, seed: int, prefix: str) -> list[Document]:
    """``n`` documents ``<prefix><i>`` of ``words`` words each (one passage at a split of at
    least ``words``)."""
    return [
        Document.create(f"{prefix}{i}", title, text)
        for i, (title, text) in enumerate(synthetic_texts(n, words, seed))
    ]


def synthetic_base(out: Path, spec: IndexSpec, n: int, words: int, seed: int) -> Manifest:
    """A ``spec`` index at ``out`` over ``n`` synthetic one-passage documents ``c<i>`` (passage
    ids ``c<i>#0``) whose vectors are seeded random unit vectors of the encoder's dimension:
    the build stages (passage store, vectors, faiss, BM25, manifest, publish) as
    ``build_index`` runs them, without running the encoder over the passages."""
    enc = load_encoder(spec.encoder, role="document")
    dim = enc.dim

    def produce(work: ShardWork) -> Iterator[tuple[int, np.ndarray]]:  # a ShardProducer
        for i in work.todo:
            a, b = work.spans[i]
            vecs = np.random.default_rng([seed, i]).standard_normal((b - a, dim), np.float32)
            vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
            work.update(b - a)
            yield i, vecs

    def passages() -> Iterator[Passage]:
        for i, (title, text) in enumerate(synthetic_texts(n, words, seed)):
            yield Passage(f"c{i}#0", title, text)

    vectors = VectorSource(
        encoder=enc.name,
        query_encoder=encoder_id(spec.query_encoder) if spec.query_encoder else enc.name,
        dim=dim,
        normalize=bool(enc.normalize),
        digest=lambda: f"random unit vectors, seed {seed}",
        produce=produce,
        desc="random vectors",
    )
    source = BuildSource(
        inputs=[],
        input_format="jsonl",
        vectors=vectors,
        passages=passages,
        fingerprint_extra={"synthetic": [n, words, seed]},
    )
    spec = replace(spec, score_scale=default_score_scale(enc))
    with build_lock(out):
        return stage_and_publish(out, spec, BuildOptions(progress=False), source, time.monotonic())


def write_corpus(path: Path, documents: Sequence[Document]) -> Path:
    """The documents as a build's JSONL input, one passage per line under the document's
    ``<id>#0`` passage id (what the API gives a one-passage document)."""
    with open(path, "w", encoding="utf-8") as f:
        for d in documents:
            f.write(json.dumps({"id": f"{d.id}#0", "title": d.title, "text": d.text}) + "\n")
    return path


def built(corpus: Path, out: Path, spec: IndexSpec) -> tuple[int, float]:
    """Build ``spec`` over ``corpus`` at ``out``: (passages, seconds)."""
    start = time.perf_counter()
    manifest = build_index([corpus], out, spec, BuildOptions(progress=False, overwrite=True))
    return manifest.count, time.perf_counter() - start


def encoder_spec(encoder: str, work: Path) -> IndexSpec:
    """The flat index the latency and compaction parts build (module docstring)."""
    if encoder == "minilm":
        return IndexSpec(name="bench")
    from openbook_testkit.index import make_tiny_dpr_encoders

    ctx, q = make_tiny_dpr_encoders(work / "tiny-dpr", projection_dim=MINILM_DIM)
    return IndexSpec(name="bench", encoder=str(ctx), query_encoder=str(q))


def percentiles(ms: Sequence[float]) -> dict[str, float]:
    return {"p50": float(np.percentile(ms, 50)), "p99": float(np.percentile(ms, 99))}


# ---------------------------------------------------------------------------- ingestion


def measure_ingestion(work: Path, sizes: Sizes, *, in_process: bool = False) -> dict:
    like = IndexSpec(name="bench-build")  # the fact indexes' spec: MiniLM, flat
    rounds = []
    with (
        _serving(work, in_process) as (url, auth),
        httpx.Client(base_url=url, headers=auth, timeout=600) as client,
    ):
        for r in range(sizes.rounds):
            docs = synthetic_documents(sizes.docs, sizes.words, seed=r, prefix=f"r{r}d")
            corpus = write_corpus(work / f"ingest-{r}.jsonl", docs)
            build_passages, build_s = built(corpus, work / f"build-{r}", like)
            api_passages, api_s = _ingest(client, f"bench-{r}", docs, sizes.batch)
            rounds.append(
                {
                    "documents": len(docs),
                    "build_passages": build_passages,
                    "build_s": round(build_s, 3),
                    "build_passages_per_s": build_passages / build_s,
                    "api_passages": api_passages,
                    "api_s": round(api_s, 3),
                    "api_passages_per_s": api_passages / api_s,
                }
            )
            shutil.rmtree(work / f"build-{r}", ignore_errors=True)
    api_rate = sum(x["api_passages"] for x in rounds) / sum(x["api_s"] for x in rounds)
    build_rate = sum(x["build_passages"] for x in rounds) / sum(x["build_s"] for x in rounds)
    ratio = api_rate / build_rate
    return {
        "batch": sizes.batch,
        "rounds": rounds,
        "api_passages_per_s": api_rate,
        "build_passages_per_s": build_rate,
        "api_over_build": ratio,
        "target": INGEST_TARGET,
        "met": ratio >= INGEST_TARGET,
    }


@contextmanager
def _serving(work: Path, in_process: bool) -> Iterator[tuple[str, dict[str, str]]]:
    """The gateway's URL and admin headers: ``openbook up``'s stack (the test kit's
    LocalStack), or (``in_process``) the same retriever, generator and gateway served in this
    process with a Redis of their own (module docstring: ``--smoke``)."""
    from openbook_testkit.rag import make_tiny_bart
    from openbook_testkit.stack import (
        LocalStack,
        RedisServer,
        build_fact_indexes,
        running_backends,
        serving_gateway,
    )

    var = work / "var"
    build_fact_indexes(var / "indexes")
    if in_process:
        redis = RedisServer(work)
        redis.start()
        try:
            with running_backends(var, redis.url) as backends:
                settings = backends.gateway_settings(redis.url)
                with serving_gateway(settings) as url:
                    yield url, {"Authorization": f"Bearer {backends.admin_token}"}
        finally:
            redis.stop()
        return
    make_tiny_bart(var / "models" / "tiny-bart")
    stack = LocalStack(var)
    stack.start()
    try:
        yield stack.url, stack.auth
    finally:
        stack.stop()


def _ingest(
    client: httpx.Client, index: str, docs: Sequence[Document], batch: int
) -> tuple[int, float]:
    """Create ``index`` like the active one, warm its encoder with one document, then write
    ``docs`` in batches: (passages written, seconds for the batches)."""
    created = client.post("/indexes", json={"name": index, "like": "facts-a"})
    created.raise_for_status()
    warm = {"title": "Warm", "text": "The encoder loads on the first write."}
    client.put(f"/indexes/{index}/documents/warm", json=warm).raise_for_status()
    passages = 0
    start = time.perf_counter()
    for at in range(0, len(docs), batch):
        body = {
            "documents": [
                {"id": d.id, "title": d.title, "text": d.text} for d in docs[at : at + batch]
            ]
        }
        reply = client.post(f"/indexes/{index}/documents:batch", json=body)
        reply.raise_for_status()
        passages += sum(reply.json()["passages"])
    return passages, time.perf_counter() - start


# ---------------------------------------------------------------------------- latency


def measure_latency(work: Path, sizes: Sizes, spec: IndexSpec) -> dict:
    base_docs = synthetic_documents(sizes.base_passages, sizes.words, seed=100, prefix="b")
    build_passages, _ = built(
        write_corpus(work / "latency.jsonl", base_docs),
        work / "latency-built",
        spec,
    )
    options = LiveOptions(verify=False)
    segment_dir, compacted_dir = work / "latency-segment", work / "latency-compacted"
    with LiveIndex.create(segment_dir, work / "latency-built", options) as live:
        segment_docs = synthetic_documents(sizes.segment, sizes.words, seed=101, prefix="s")
        write_s = _write_all(live, segment_docs)
        segment = live.segment_size
    shutil.copytree(segment_dir, compacted_dir)
    with LiveIndex(compacted_dir, options) as to_compact:
        compaction = to_compact.compact()
    assert compaction is not None
    rng = random.Random(7)
    queries = [" ".join(rng.choices(_VOCABULARY, k=8)) for _ in range(sizes.queries)]
    k = 5
    times: dict[str, dict[str, list[float]]] = {
        state: {"dense": [], "bm25": []} for state in ("segment", "compacted")
    }
    with LiveIndex(segment_dir, options) as seg, LiveIndex(compacted_dir, options) as comp:
        indexes = {"segment": seg, "compacted": comp}
        vectors = seg.query_encoder.encode(queries)
        for index in indexes.values():  # warm: page cache, bm25 mmap, cached segment arrays
            index.search(
                SearchRequest(queries[:3], k=k, query_vectors=vectors[:3], retrieval="dense")
            )
            index.search(SearchRequest(queries[:3], k=k, retrieval="bm25"))
        for i, q in enumerate(queries):
            for state, index in indexes.items():
                start = time.perf_counter()
                index.search(
                    SearchRequest([q], k=k, query_vectors=vectors[i : i + 1], retrieval="dense")
                )
                times[state]["dense"].append(1000 * (time.perf_counter() - start))
                start = time.perf_counter()
                index.search(SearchRequest([q], k=k, retrieval="bm25"))
                times[state]["bm25"].append(1000 * (time.perf_counter() - start))
    ms = {state: {m: percentiles(t) for m, t in modes.items()} for state, modes in times.items()}
    ratios = {m: ms["segment"][m]["p50"] / ms["compacted"][m]["p50"] for m in ("dense", "bm25")}
    return {
        "base_passages": build_passages,
        "segment_passages": segment,
        "segment_write_s": round(write_s, 3),
        "compaction_s": compaction.seconds,
        "queries": len(queries),
        "k": k,
        "ms": ms,
        "segment_over_compacted_p50": ratios,
        "target": LATENCY_TARGET,
        "met": all(r <= LATENCY_TARGET for r in ratios.values()),
    }


def _write_all(live: LiveIndex, docs: Sequence[Document]) -> float:
    start = time.perf_counter()
    for at in range(0, len(docs), WRITE_BATCH):
        live.put_many(docs[at : at + WRITE_BATCH])
    return time.perf_counter() - start


# ---------------------------------------------------------------------------- compaction


def measure_compaction(work: Path, sizes: Sizes, spec: IndexSpec, demo: Path | None) -> dict:
    """Each synthetic index, and a copy of ``demo`` when it exists; each prepared in this
    process and compacted in a child process (a fresh high-water mark)."""
    spawn = get_context("spawn")
    results: dict[str, list[dict] | dict | str] = {}
    synthetic = []
    for n in sizes.n:
        root = work / f"compact-synthetic-{n}"
        prepare_s = _prepare_synthetic(root, n, sizes, spec)
        with ProcessPoolExecutor(1, mp_context=spawn) as pool:
            compacted = pool.submit(_compact_in_child, root).result()
        synthetic.append(
            {
                **compacted,
                "documents": n,
                "written": sizes.compact_segment,
                "prepare_s": round(prepare_s, 1),
            }
        )
        shutil.rmtree(root, ignore_errors=True)
    results["synthetic"] = synthetic
    if demo is None or not (demo / "manifest.json").exists():
        results["demo"] = f"not run: {demo} is not a built index" if demo else "not asked"
        return results
    copy = work / "compact-demo"
    _prepare_demo(demo, copy, sizes)
    with ProcessPoolExecutor(1, mp_context=spawn) as pool:
        compacted = pool.submit(_compact_in_child, copy).result()
    results["demo"] = {**compacted, "index": str(demo), "written": sizes.compact_segment}
    shutil.rmtree(copy, ignore_errors=True)
    return results


def _prepare_synthetic(root: Path, n: int, sizes: Sizes, spec: IndexSpec) -> float:
    """A live index at ``root`` whose base is a synthetic index of ``n`` documents (built in
    place as its ``base-0``, adopted on open: no copy), ``--compact-segment`` documents
    written to it; returns the seconds taken."""
    start = time.perf_counter()
    root.mkdir(parents=True)
    synthetic_base(root / f"{BASE_PREFIX}{0:012d}", spec, n, sizes.words, seed=200)
    with LiveIndex(root, LiveOptions(verify=False)) as live:
        _write_all(live, _written(sizes))
    return time.perf_counter() - start


def _prepare_demo(demo: Path, copy: Path, sizes: Sizes) -> None:
    with LiveIndex.create(copy, demo, LiveOptions(verify=False)) as live:
        _write_all(live, _written(sizes))


def _written(sizes: Sizes) -> list[Document]:
    return synthetic_documents(sizes.compact_segment, sizes.words, seed=201, prefix="new")


def _compact_in_child(path: Path) -> dict:
    """Open the live index at ``path`` and compact it: seconds, CPU seconds (of this process,
    which a busy machine does not inflate as it does the wall clock), passages, RSS once open
    and the process's peak RSS (GiB)."""
    import psutil

    with LiveIndex(path, LiveOptions(verify=False)) as live:
        open_rss = psutil.Process().memory_info().rss
        cpu = _own_cpu_seconds()
        result = live.compact()
        cpu = _own_cpu_seconds() - cpu
    assert result is not None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {
        "passages": result.passages,
        "seconds": result.seconds,
        "cpu_s": round(cpu, 1),
        "open_rss_gib": round(open_rss / 2**30, 3),
        "peak_rss_gib": round(peak / 2**30, 3),
    }


def _own_cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime


# ---------------------------------------------------------------------------- report


def report_lines(report: dict) -> Iterator[str]:
    ing = report.get("ingestion")
    if ing:
        yield (
            f"ingestion: API {ing['api_passages_per_s']:.1f} passages/s (batches of "
            f"{ing['batch']}), build {ing['build_passages_per_s']:.1f} passages/s: "
            f"{ing['api_over_build']:.2f}x (target >= {INGEST_TARGET}: "
            f"{'met' if ing['met'] else 'NOT met'})"
        )
    lat = report.get("latency", {})
    for mode, ratio in lat.get("segment_over_compacted_p50", {}).items():
        seg, comp = lat["ms"]["segment"][mode], lat["ms"]["compacted"][mode]
        yield (
            f"latency {mode}: segment of {lat['segment_passages']} p50 {seg['p50']:.2f} ms "
            f"p99 {seg['p99']:.2f} ms; compacted p50 {comp['p50']:.2f} ms p99 "
            f"{comp['p99']:.2f} ms: {ratio:.2f}x (target <= {LATENCY_TARGET})"
        )
    for name, runs in report.get("compaction", {}).items():
        for c in runs if isinstance(runs, list) else [runs]:
            if isinstance(c, str):
                yield f"compaction {name}: {c}"
            else:
                yield (
                    f"compaction {name}: {c['passages']} passages in {c['seconds']:.1f} s "
                    f"({c['cpu_s']:.1f} CPU s), RSS open {c['open_rss_gib']:.2f} GiB, peak "
                    f"{c['peak_rss_gib']:.2f} GiB"
                )


def _cpu_seconds() -> float:
    own, children = (
        resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=2000, help="ingestion: documents per round")
    ap.add_argument("--batch", type=int, default=100, help="ingestion: documents per call")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--base-passages", type=int, default=1000)
    ap.add_argument("--segment", type=int, default=10_000)
    ap.add_argument("--queries", type=int, default=300)
    ap.add_argument(
        "--n",
        type=int,
        nargs="+",
        default=[100_000],
        help="compaction: synthetic documents, one synthetic index per size",
    )
    ap.add_argument("--compact-segment", type=int, default=1000)
    ap.add_argument("--words", type=int, default=80)
    ap.add_argument(
        "--encoder",
        choices=ENCODERS,
        default="tiny",
        help="latency and compaction parts: the test kit's tiny random DPR with MiniLM's 384 "
        "dims (only the index is timed) or MiniLM itself (it encodes the latency part's "
        "passages and the documents written before a compaction)",
    )
    ap.add_argument("--demo", type=Path, default=Path("var/indexes/wiki-2016"))
    ap.add_argument("--work", type=Path, default=None, help="scratch dir (default: a temp dir)")
    ap.add_argument(
        "--parts", nargs="+", choices=PARTS, default=list(PARTS), help="what to measure"
    )
    ap.add_argument("--smoke", action="store_true", help="every part at tiny sizes")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.smoke:
        sizes = Sizes(20, 10, 1, 30, 40, 10, (60,), 10, 30)
    else:
        sizes = Sizes(
            args.docs,
            args.batch,
            args.rounds,
            args.base_passages,
            args.segment,
            args.queries,
            tuple(args.n),
            args.compact_segment,
            args.words,
        )
    with tempfile.TemporaryDirectory(prefix="docbench-", dir=args.work) as tmp:
        work = Path(tmp)
        spec = encoder_spec(args.encoder, work)
        started = time.perf_counter()
        report: dict = {
            "machine": platform.processor() or platform.machine(),
            "sizes": asdict(sizes),
            "encoder": args.encoder,
        }
        parts = {
            "ingestion": lambda: measure_ingestion(work, sizes, in_process=args.smoke),
            "latency": lambda: measure_latency(work, sizes, spec),
            "compaction": lambda: measure_compaction(work, sizes, spec, args.demo),
        }
        report["cpu_s"] = {}
        for part, measure in parts.items():
            if part in args.parts:
                cpu = _cpu_seconds()
                report[part] = measure()
                # CPU seconds of this process and its children: what a part costs whatever
                # the machine's load (the smoke run's budget in CI).
                report["cpu_s"][part] = round(_cpu_seconds() - cpu, 1)
    report["seconds"] = round(time.perf_counter() - started, 1)
    for line in report_lines(report):
        print(line)
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
