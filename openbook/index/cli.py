"""`openbook index ...`: build and inspect indexes."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from tqdm.auto import tqdm

from openbook.errors import OpenbookError
from openbook.index.build import build_index
from openbook.index.engine import EngineKind, RetrievalMode, check_milvus_uri
from openbook.index.fusion import Fusion, fit_fusion, read_questions, store_fusion
from openbook.index.importer import import_embeddings
from openbook.index.join import join_slices
from openbook.index.loaded import open_index
from openbook.index.manifest import MANIFEST, IndexLoadError, Manifest
from openbook.index.option_groups import takes_option_groups
from openbook.index.parallel import SET_MANIFEST, build_slice, read_index_set
from openbook.index.request import SearchRequest
from openbook.index.shard import split_index
from openbook.index.spec import AnnParams, BuildOptions, IndexSpec
from openbook.security.secrets import read_secret
from openbook.validation.limits import check_index_name
from openbook.validation.metadata_filter import parse_filter_json

if TYPE_CHECKING:
    from openbook.index.milvus_build import MilvusBuilt, MilvusTarget

app = typer.Typer(help="Build and inspect indexes", no_args_is_help=True)


class IndexType(StrEnum):
    flat = "flat"
    hnsw = "hnsw"
    hnsw_sq8 = "hnsw-sq8"
    ivfpq = "ivfpq"
    bm25 = "bm25"


class HnswTransform(StrEnum):
    none = "none"
    mips_to_l2 = "mips_to_l2"


class CoarseQuantizer(StrEnum):
    flat = "flat"
    hnsw = "hnsw"


class Precision(StrEnum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class InputFormat(StrEnum):
    auto = "auto"
    jsonl = "jsonl"
    dpr_tsv = "dpr-tsv"
    articles = "articles"


# The ANN parameters' options, alike for `build` and `import` (AnnParams, spec.py).
HnswM = Annotated[int, typer.Option(min=2)]
EfConstruction = Annotated[int, typer.Option(min=1)]
EfSearch = Annotated[int, typer.Option(min=1)]
HnswTransformOption = Annotated[
    HnswTransform, typer.Option(help="hnsw: native inner product or DPR's MIPS->L2")
]
Nlist = Annotated[int | None, typer.Option(min=1, help="ivfpq: inverted lists")]
PqM = Annotated[int | None, typer.Option(min=1, help="ivfpq: PQ sub-quantizers")]
Nprobe = Annotated[int, typer.Option(min=1, help="ivfpq: lists probed per query")]
Rerank = Annotated[
    int, typer.Option(min=0, help="Re-rank k*N candidates exactly (approximate types)")
]
CoarseQuantizerOption = Annotated[
    CoarseQuantizer,
    typer.Option(
        help="ivfpq: assign to lists exactly (flat) or through an HNSW graph of the centroids "
        "(hnsw: --hnsw-m, --ef-construction, --ef-search; affordable with many lists)"
    ),
]


@dataclass(frozen=True)
class AnnOptions:
    """The ANN parameters' options of ``build`` and ``import`` (takes_option_groups)."""

    hnsw_m: HnswM = 32
    ef_construction: EfConstruction = 128
    ef_search: EfSearch = 128
    hnsw_transform: HnswTransformOption = HnswTransform.none
    nlist: Nlist = None
    pq_m: PqM = None
    nprobe: Nprobe = 16
    rerank: Rerank = 0
    coarse_quantizer: CoarseQuantizerOption = CoarseQuantizer.flat

    def params(self) -> AnnParams:
        """The ANN parameters these options give (validated by AnnParams)."""
        return AnnParams(
            hnsw_m=self.hnsw_m,
            ef_construction=self.ef_construction,
            ef_search=self.ef_search,
            hnsw_transform=self.hnsw_transform.value,
            nlist=self.nlist,
            pq_m=self.pq_m,
            nprobe=self.nprobe,
            rerank=self.rerank,
            coarse_quantizer=self.coarse_quantizer.value,
        )


# Where `build` and `import` write (issue 41): the settings the retriever reads, as options.
EngineOption = Annotated[
    EngineKind,
    typer.Option(
        envvar="OPENBOOK_INDEX_ENGINE",
        help="files: an index directory at --out; milvus: straight into the Milvus at "
        "--milvus-uri (batches, progress, resumable)",
    ),
]
MilvusUri = Annotated[
    str | None,
    typer.Option(
        envvar="OPENBOOK_MILVUS_URI",
        help="--engine milvus: http(s)://host:port of a server, or a local path ending in .db "
        "(Milvus Lite, in this process; no retriever may hold it open meanwhile)",
    ),
]
MilvusTokenFile = Annotated[
    Path | None,
    typer.Option(
        envvar="OPENBOOK_MILVUS_TOKEN_FILE",
        help="A file holding the token of a Milvus that needs one (user:password or a key)",
    ),
]
MilvusShards = Annotated[
    int | None,
    typer.Option(min=1, help="--engine milvus: the collection's num_shards (Milvus's shards)"),
]
WorkDir = Annotated[
    Path | None,
    typer.Option(
        help="--engine milvus: the local directory of the stages before the inserts, kept "
        "to resume (default var/milvus-builds/NAME); removed once the build completes"
    ),
]


@dataclass(frozen=True)
class MilvusOptions:
    """Where ``build`` and ``import`` write: the files engine at ``--out``, or a Milvus
    (takes_option_groups)."""

    engine: EngineOption = EngineKind.FILES
    milvus_uri: MilvusUri = None
    milvus_token_file: MilvusTokenFile = None
    milvus_shards: MilvusShards = None
    work_dir: WorkDir = None

    def target(self, out: Path | None, name: str) -> MilvusTarget | None:
        """Where ``--engine milvus`` writes (None: the files engine, at ``--out``); a clean CLI
        error for an option of the other engine, a missing one or a bad one."""
        try:
            return self._target(out, name)
        except ValueError as e:
            raise _fail(str(e)) from None

    def _target(self, out: Path | None, name: str) -> MilvusTarget | None:
        if self.engine is EngineKind.FILES:
            if out is None:
                raise _fail("--out: name the index directory to create (or pass --engine milvus)")
            if self.milvus_shards is not None or self.work_dir is not None:
                raise _fail("--milvus-shards / --work-dir are --engine milvus options")
            return None
        if out is not None:
            raise _fail("--out: a build with --engine milvus writes into Milvus, not a directory")
        if not self.milvus_uri:
            raise _fail("--milvus-uri (or OPENBOOK_MILVUS_URI): name the Milvus to write into")
        check_index_name("--name", name)
        token_file = self.milvus_token_file
        token = read_secret(token_file, "Milvus token (--milvus-token-file)") if token_file else ""
        # why: pymilvus (and Milvus Lite) stay out of every files-engine `openbook index` command
        from openbook.index.milvus_build import MilvusTarget

        return MilvusTarget(
            uri=check_milvus_uri(self.milvus_uri),
            work_dir=self.work_dir or Path("var/milvus-builds") / name,
            token=token,
            shards=self.milvus_shards,
        )


def _built_into_milvus(verb: str, built: MilvusBuilt, uri: str) -> None:
    if built.resumed_at:
        typer.echo(f"resumed a build cut short at passage {built.resumed_at}")
    m = built.manifest
    typer.echo(
        f"{verb} index {built.name!r} ({m.index_type}, {built.count} passages, dim {m.dim}) "
        f"in {built.seconds:.1f}s -> Milvus at {uri} (views: {', '.join(m.views)})"
    )


def _built_into_files(verb: str, m: Manifest, out: Path) -> None:
    typer.echo(
        f"{verb} index {m.name!r} ({m.index_type}, {m.count} passages, dim {m.dim}) "
        f"in {m.build_seconds:.1f}s -> {out}"
    )


def _fail(msg: str) -> typer.Exit:
    typer.secho(f"error: {msg}", err=True, fg=typer.colors.RED)
    return typer.Exit(code=2)


@app.command()
@takes_option_groups
def build(
    passages: Annotated[
        list[Path], typer.Option("--passages", "-p", help="Input file (repeatable)")
    ],
    name: Annotated[str, typer.Option(help="Index name recorded in the manifest")],
    out: Annotated[
        Path | None,
        typer.Option(
            help="Index directory to create; with --num-shards the set's root (OUT/shard-<i>/NAME"
            " after join-shards)"
        ),
    ] = None,
    encoder: Annotated[
        str, typer.Option(help="Document encoder (alias or local dir)")
    ] = "all-MiniLM-L6-v2",
    query_encoder: Annotated[
        str | None, typer.Option(help="Query encoder if different (e.g. DPR question encoder)")
    ] = None,
    type: Annotated[IndexType, typer.Option("--type", help="Index type")] = IndexType.flat,
    format: Annotated[InputFormat, typer.Option("--format", help="Input format")] = (
        InputFormat.auto
    ),
    batch_size: Annotated[int, typer.Option(min=1)] = 64,
    shard_size: Annotated[int, typer.Option(min=1)] = 50_000,
    max_words: Annotated[int, typer.Option(min=1, help="Words per passage when splitting")] = 100,
    ann: AnnOptions = AnnOptions(),
    overwrite: Annotated[bool, typer.Option(help="Replace an existing index at --out")] = False,
    progress: Annotated[bool, typer.Option(help="Show progress bars")] = True,
    device: Annotated[
        str | None, typer.Option(help="Where to run the document encoder (cpu, cuda, cuda:1)")
    ] = None,
    score_scale: Annotated[
        float | None,
        typer.Option(
            help="Multiply scores (the prior's logits) by this; default 20 for encoders that "
            "normalise (cosine), else 1"
        ),
    ] = None,
    precision: Annotated[
        Precision,
        typer.Option(help="Encoder dtype; auto: float32 on CPU, bfloat16 (else float16) on CUDA"),
    ] = Precision.auto,
    num_shards: Annotated[
        int | None,
        typer.Option(min=1, help="Build one slice of N for a parallel build (see join-shards)"),
    ] = None,
    shard_id: Annotated[
        int | None, typer.Option(help="Which slice (0..N-1): e.g. $JOB_COMPLETION_INDEX")
    ] = None,
    bm25: Annotated[
        bool,
        typer.Option(
            help="Give a dense index a BM25 view of the same passages too (hybrid retrieval)"
        ),
    ] = True,
    reuse_vectors_from: Annotated[
        list[Path] | None,
        typer.Option(
            help="A dense index of the same encoder whose vectors identical passages take "
            "instead of being encoded again (checked on a sample; repeatable)"
        ),
    ] = None,
    milvus: MilvusOptions = MilvusOptions(),
) -> None:
    """Build an index from passage files (resumes an interrupted build of the same inputs).

    With --num-shards N --shard-id I: build slice I of N (contiguous passages) as a complete
    serving shard, staged until `openbook index join-shards OUT --num-shards N` publishes the
    set; run the N slices in parallel, on N GPUs or nodes.

    With --engine milvus (or OPENBOOK_INDEX_ENGINE=milvus): no --out; the passages are
    encoded shard by shard (--shard-size) and each shard written into the Milvus at
    --milvus-uri with its BM25 weights; the same command resumes a build cut short from its
    last written shard (openbook/index/milvus_build.py).
    """
    if (num_shards is None) != (shard_id is None):
        raise _fail("--num-shards and --shard-id go together")
    target = milvus.target(out, name)
    if target is not None and num_shards is not None:
        raise _fail("--num-shards: slices are files builds; Milvus shards itself (--milvus-shards)")
    try:
        spec = IndexSpec(
            name=name,
            index_type=type.value,
            encoder=encoder,
            query_encoder=query_encoder,
            score_scale=score_scale,
            max_words=max_words,
            bm25=bm25,
            ann=ann.params(),
        )
        options = BuildOptions(
            batch_size=batch_size,
            shard_size=shard_size,
            device=device,
            precision=precision.value,
            progress=progress,
            overwrite=overwrite,
            input_format=format.value,
            reuse_vectors_from=tuple(reuse_vectors_from or ()),
        )
    except ValueError as e:
        raise _fail(str(e)) from None
    if target is not None:
        # why: pymilvus (and Milvus Lite) stay out of every files-engine `openbook index` command
        from openbook.index.milvus_build import build_into_milvus

        try:
            built = build_into_milvus(passages, target, spec, options)
        except (OpenbookError, ValueError, OSError, RuntimeError) as e:
            raise _fail(str(e)) from None
        _built_into_milvus("built", built, target.uri)
        return
    assert out is not None  # MilvusOptions.target: the files engine has its --out
    if num_shards is not None and shard_id is not None:
        if ann.nlist is not None or ann.pq_m is not None:
            raise _fail("--nlist / --pq-m are ivfpq options; slices cannot be ivfpq")
        _build_slice(passages, out, spec, options, num_shards=num_shards, shard_id=shard_id)
        return
    try:
        manifest = build_index(passages, out, spec, options)
    except (ValueError, OSError, RuntimeError) as e:
        raise _fail(str(e)) from None
    _built_into_files("built", manifest, out)


def _build_slice(
    passages: list[Path],
    out: Path,
    spec: IndexSpec,
    options: BuildOptions,
    *,
    num_shards: int,
    shard_id: int,
) -> None:
    try:
        res = build_slice(passages, out, spec, options, num_shards=num_shards, shard_id=shard_id)
    except (ValueError, OSError, RuntimeError) as e:
        raise _fail(str(e)) from None
    m, (start, stop) = res.manifest, res.span
    what = f"slice {shard_id} of {num_shards} (rows {start}..{stop - 1} of {res.total})"
    if res.state == "built":
        typer.echo(f"built {what} in {m.build_seconds:.1f}s -> {res.path}")
    else:
        typer.echo(f"{what}: {res.state} -> {res.path}")
    if res.state != "already joined":
        typer.echo(
            f"join with: openbook index join-shards {out} --num-shards {num_shards}",
            err=True,
        )


class EmbeddingsFormat(StrEnum):
    auto = "auto"
    pickle = "pickle"
    parquet = "parquet"
    arrow = "arrow"


@app.command("import")
@takes_option_groups
def import_(
    embeddings: Annotated[
        list[Path],
        typer.Argument(help="Embedding files: DPR pickle shards or wiki_dpr parquet/arrow"),
    ],
    name: Annotated[str, typer.Option(help="Index name recorded in the manifest")],
    doc_encoder: Annotated[
        str, typer.Option(help="Encoder that computed the vectors (recorded in the manifest)")
    ],
    query_encoder: Annotated[
        str, typer.Option(help="Query encoder the retriever loads (alias or local dir)")
    ],
    passages: Annotated[
        Path | None,
        typer.Option(
            "--passages",
            "-p",
            help="DPR passages file (psgs_w100.tsv); default: the parquet/arrow files' text",
        ),
    ] = None,
    type: Annotated[IndexType, typer.Option("--type", help="Index type (dense)")] = (
        IndexType.flat
    ),
    format: Annotated[
        EmbeddingsFormat, typer.Option("--format", help="Embeddings format")
    ] = EmbeddingsFormat.auto,
    batch_size: Annotated[int, typer.Option(min=1, help="Vectors read at a time")] = 10_000,
    shard_size: Annotated[int, typer.Option(min=1)] = 50_000,
    ann: AnnOptions = AnnOptions(),
    score_scale: Annotated[
        float, typer.Option(help="Multiply scores by this (1: DPR's raw inner products)")
    ] = 1.0,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing index at --out")] = False,
    progress: Annotated[bool, typer.Option(help="Show progress bars")] = True,
    bm25: Annotated[
        bool, typer.Option(help="Also index the passages with BM25 (hybrid retrieval)")
    ] = True,
    out: Annotated[Path | None, typer.Option(help="Index directory to create")] = None,
    milvus: MilvusOptions = MilvusOptions(),
) -> None:
    """Build an index from DPR passages + precomputed embeddings, without encoding
    (resumes an interrupted import of the same files). With --engine milvus: no --out, the
    vectors written into the Milvus at --milvus-uri shard by shard (--shard-size), resumable
    as `build` is."""
    if type is IndexType.bm25:
        raise _fail("bm25 takes no embeddings; use a dense --type")
    target = milvus.target(out, name)
    try:
        spec = IndexSpec(
            name=name,
            index_type=type.value,
            encoder=doc_encoder,
            query_encoder=query_encoder,
            score_scale=score_scale,
            bm25=bm25,
            ann=ann.params(),
        )
        options = BuildOptions(
            batch_size=batch_size, shard_size=shard_size, progress=progress, overwrite=overwrite
        )
        if target is not None:
            # why: pymilvus (and Milvus Lite) stay out of every files-engine index command
            from openbook.index.milvus_build import import_into_milvus

            built = import_into_milvus(
                passages, embeddings, target, spec, options, embeddings_format=format.value
            )
            _built_into_milvus("imported", built, target.uri)
            return
        assert out is not None  # MilvusOptions.target: the files engine has its --out
        manifest = import_embeddings(
            passages, embeddings, out, spec, options, embeddings_format=format.value
        )
    except (OpenbookError, ValueError, OSError) as e:  # EmbeddingsError is a ValueError
        raise _fail(str(e)) from None
    _built_into_files("imported", manifest, out)


@app.command("join-shards")
def join_shards(
    out_root: Annotated[Path, typer.Argument(help="The --out the slices were built with")],
    num_shards: Annotated[int, typer.Option(min=1, help="How many slices make up the index")],
    if_complete: Annotated[
        bool,
        typer.Option(help="Exit 0 without joining while slices are missing (the last one joins)"),
    ] = False,
    into: Annotated[
        Path | None,
        typer.Option(
            help="Also install shard i at INTO/shard-<i>/NAME beside other indexes (hard links), "
            "e.g. $OPENBOOK_INDEX_ROOT/shards for the sharded retrievers"
        ),
    ] = None,
    merge: Annotated[
        Path | None, typer.Option(help="Also write one unsharded index here from the slices")
    ] = None,
    merge_type: Annotated[
        IndexType | None,
        typer.Option(help="Index type of the merged index (default: the slices'); e.g. hnsw-sq8"),
    ] = None,
    progress: Annotated[bool, typer.Option(help="Show progress bars")] = True,
) -> None:
    """Check that the N slices of a parallel build agree and publish them as one index set at
    OUT_ROOT (OUT_ROOT/shard-<i>/NAME, served with OPENBOOK_INDEX_ROOT=OUT_ROOT/shard-<i>)."""
    try:
        res = join_slices(
            out_root,
            num_shards,
            if_complete=if_complete,
            into=into,
            merge=merge,
            merge_type=merge_type.value if merge_type else None,
            progress=progress,
        )
    except (ValueError, OSError, RuntimeError) as e:  # IndexLoadError is a ValueError
        raise _fail(str(e)) from None
    if res.index_set is None:
        built = num_shards - len(res.missing)
        typer.echo(
            f"{built} of {num_shards} slices built; missing: {', '.join(res.missing)}. "
            "Not joining yet: the last slice's join will."
        )
        return
    s = res.index_set
    typer.echo(f"{res.state} {s.name!r}: {s.num_shards} shards, {s.count} passages -> {out_root}")
    for p in res.installed:
        typer.echo(f"installed {p}")
    if res.merged is not None:
        typer.echo(f"merged {res.merged.index_type} index, {res.merged.count} passages -> {merge}")


@app.command()
def info(
    path: Annotated[Path, typer.Argument(help="Index directory")],
    verify: Annotated[bool, typer.Option(help="Re-hash every file against the manifest")] = False,
) -> None:
    """Print an index's manifest as JSON (optionally verifying checksums); for the root of a
    joined parallel build, its shards.json."""
    try:
        if not path.is_dir():
            raise IndexLoadError(f"{path}: index directory not found")
        if (path / SET_MANIFEST).is_file() and not (path / MANIFEST).is_file():
            typer.echo(read_index_set(path).to_json(), nl=False)  # a joined set: its shards.json
            return
        if verify:
            open_index(path, verify=True).close()
        manifest = Manifest.from_file(path / MANIFEST)
    except (IndexLoadError, OSError) as e:
        raise _fail(str(e)) from None
    typer.echo(json.dumps(asdict(manifest), indent=2, sort_keys=True))
    typer.echo(f"engine: {EngineKind.FILES} (to-milvus copies it into Milvus)", err=True)
    typer.echo(_views_line(manifest), err=True)
    if verify:
        typer.echo("verified: ok", err=True)


def _views_line(m: Manifest) -> str:
    """One line on what ``retrieval`` can be for this index and how hybrid fuses."""
    line = f"views: {', '.join(m.views)}"
    if m.views == ["dense", "bm25"]:
        f = Fusion.from_dict(m.fusion) if m.fusion else Fusion.default(m.score_scale)
        how = (
            f"fitted on {f.fitted_on.get('questions')} questions ({f.fitted_on.get('source')})"
            if f.fitted_on
            else "default, not fitted"
        )
        line += (
            f"; default retrieval {m.default_retrieval}; hybrid: s = {f.dense_weight:.4g}*dense"
            f" + {f.bm25_weight:.4g}*bm25 over {f.candidates} candidates per view, {how}"
        )
    return line


@app.command("to-milvus")
def to_milvus(
    path: Annotated[Path, typer.Argument(help="A built index directory")],
    uri: Annotated[
        str,
        typer.Option(
            envvar="OPENBOOK_MILVUS_URI",
            help="The Milvus: http(s)://host:port of a server, or a local path ending in .db "
            "(Milvus Lite, in this process; no retriever may hold it open meanwhile)",
        ),
    ],
    name: Annotated[
        str, typer.Option(help="The index's name in Milvus (default: the directory's name)")
    ] = "",
    index_type: Annotated[
        IndexType | None,
        typer.Option(
            "--type",
            help="Milvus's index of the vectors: flat, hnsw, hnsw-sq8 or ivfpq (default: "
            "the source's type)",
        ),
    ] = None,
    token_file: Annotated[
        Path | None,
        typer.Option(
            envvar="OPENBOOK_MILVUS_TOKEN_FILE",
            help="A file holding the token of a Milvus that needs one (user:password or a key)",
        ),
    ] = None,
) -> None:
    """Copy a built files index into Milvus (OPENBOOK_INDEX_ENGINE=milvus) with its stored
    vectors and BM25 weights, nothing re-encoded: its passages become documents as the files
    engine adopts a built index, version 0. The index must not exist there yet, unless a copy
    of the same index was cut short: the command then resumes it from its last batch."""
    target = name or path.name
    try:
        check_index_name("--name", target)
        # why: pymilvus (and Milvus Lite) stay out of every other `openbook index` command
        from openbook.index.milvus_engine import MilvusEngine

        with open_index(path, verify=True, name=target) as source:
            token = read_secret(token_file, "Milvus token (--token-file)") if token_file else ""
            engine = MilvusEngine(uri, token=token)
            try:
                with tqdm(total=len(source), unit="psg", desc=f"to Milvus: {target}") as bar:

                    def progress(done: int, total: int) -> None:
                        bar.update(done - bar.n)

                    copied = engine.copy_index(
                        target,
                        source,
                        index_type=index_type.value if index_type else None,
                        progress=progress,
                    )
                count, m = len(copied.index), copied.index.manifest
            finally:
                engine.close()
    except (IndexLoadError, OpenbookError, OSError, ValueError) as e:
        raise _fail(str(e)) from None
    if copied.resumed_at:
        typer.echo(f"resumed a copy cut short at passage {copied.resumed_at}")
    typer.echo(
        f"copied {count} passages of {path} into Milvus at {uri} as {target!r} "
        f"({m.index_type}, dim {m.dim}, views: {', '.join(m.views)})"
    )


@app.command()
def search(
    path: Annotated[Path, typer.Argument(help="Index directory")],
    queries: Annotated[list[str], typer.Argument(help="Query text(s)")],
    k: Annotated[int, typer.Option("-k", min=1)] = 5,
    retrieval: Annotated[
        RetrievalMode | None,
        typer.Option(help="dense, bm25 or hybrid (default: hybrid where both views exist)"),
    ] = None,
    filter_json: Annotated[
        str,
        typer.Option(
            "--filter",
            help='Metadata filter as JSON, e.g. \'{"_title": "Hamlet"}\' (a built index '
            "matches its built-in _id and _title only)",
        ),
    ] = "",
) -> None:
    """Search an index from the command line (for eyeballing results)."""
    try:
        where = parse_filter_json(filter_json, "--filter")
        with open_index(path, verify=False) as idx:
            results = idx.search(SearchRequest(queries, k=k, retrieval=retrieval, where=where))
    except (IndexLoadError, ValueError, OSError) as e:
        raise _fail(str(e)) from None
    for q, hits in zip(queries, results, strict=True):
        typer.echo(f"# {q}")
        for rank, p in enumerate(hits, 1):
            snippet = p.text if len(p.text) <= 100 else p.text[:97] + "..."
            typer.echo(f"{rank:>3} {p.score:9.4f}  {p.id}  [{p.title}] {snippet}")


@app.command("fit-fusion")
def fit_fusion_(
    path: Annotated[Path, typer.Argument(help="Index directory (dense with a bm25 view)")],
    questions: Annotated[
        Path,
        typer.Option(help='Training questions, jsonl: {"question", "answers"[, "title"]}'),
    ],
    exclude_titles: Annotated[
        list[str] | None,
        typer.Option(help="Leave out questions with this title, e.g. dev articles (repeatable)"),
    ] = None,
    candidates: Annotated[
        int, typer.Option(min=1, help="Candidates per view (the fused top-k comes from these)")
    ] = 50,
) -> None:
    """Fit the hybrid fusion's weights on training questions and record it in the manifest.

    Maximises the likelihood the fused prior gives the candidates that contain an answer
    (openbook/index/README.md, "Hybrid retrieval"); only manifest.json is rewritten.
    """
    try:
        qs, sha = read_questions(questions, exclude_titles or ())
        with open_index(path, verify=False) as idx:
            fusion = fit_fusion(idx, qs, candidates=candidates, source=str(questions), sha256=sha)
        store_fusion(path, fusion)
    except (IndexLoadError, ValueError, OSError) as e:
        raise _fail(str(e)) from None
    assert fusion.fitted_on is not None
    typer.echo(
        f"fitted on {fusion.fitted_on['questions']} of {len(qs)} questions: "
        f"s = {fusion.dense_weight:.4g}*dense + {fusion.bm25_weight:.4g}*bm25, "
        f"log-likelihood {fusion.log_likelihood:.4f} per question -> {path}"
    )


@app.command()
def shard(
    src: Annotated[Path, typer.Argument(help="Index directory to split")],
    shards: Annotated[int, typer.Option("--shards", help="Number of shards (>= 2)")],
    out_root: Annotated[
        Path,
        typer.Option(help="Directory to create; shard i goes to OUT_ROOT/shard-<i>/<src name>"),
    ],
    progress: Annotated[bool, typer.Option(help="Show progress bars")] = True,
) -> None:
    """Split an index into N shards, each served by its own retriever (contiguous rows)."""
    try:
        paths = split_index(src, shards, out_root, progress=progress)
    except (ValueError, OSError) as e:  # IndexLoadError is a ValueError
        raise _fail(str(e)) from None
    for p in paths:
        typer.echo(str(p))
    typer.echo(f"serve shard i with OPENBOOK_INDEX_ROOT={out_root}/shard-<i>", err=True)


if __name__ == "__main__":
    app()
