"""`openbook index ...`: build and inspect indexes."""

from __future__ import annotations

import json
from dataclasses import asdict
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

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


class InputFormat(StrEnum):
    auto = "auto"
    jsonl = "jsonl"
    dpr_tsv = "dpr-tsv"
    articles = "articles"


def _fail(msg: str) -> typer.Exit:
    typer.secho(f"error: {msg}", err=True, fg=typer.colors.RED)
    return typer.Exit(code=2)


@app.command()
def build(
    passages: Annotated[
        list[Path], typer.Option("--passages", "-p", help="Input file (repeatable)")
    ],
    name: Annotated[str, typer.Option(help="Index name recorded in the manifest")],
    out: Annotated[Path, typer.Option(help="Index directory to create")],
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
    hnsw_m: Annotated[int, typer.Option(min=2)] = 32,
    ef_construction: Annotated[int, typer.Option(min=1)] = 128,
    ef_search: Annotated[int, typer.Option(min=1)] = 128,
    hnsw_transform: Annotated[
        HnswTransform, typer.Option(help="hnsw: native inner product or DPR's MIPS->L2")
    ] = HnswTransform.none,
    nlist: Annotated[int | None, typer.Option(min=1, help="ivfpq: inverted lists")] = None,
    pq_m: Annotated[int | None, typer.Option(min=1, help="ivfpq: PQ sub-quantizers")] = None,
    nprobe: Annotated[int, typer.Option(min=1, help="ivfpq: lists probed per query")] = 16,
    rerank: Annotated[
        int, typer.Option(min=0, help="Re-rank k*N candidates exactly (approximate types)")
    ] = 0,
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
) -> None:
    """Build an index from passage files (resumes an interrupted build of the same inputs)."""
    from openbook.index.build import build_index

    try:
        manifest = build_index(
            passages,
            out,
            name=name,
            encoder=encoder,
            query_encoder=query_encoder,
            index_type=type.value,
            input_format=format.value,
            batch_size=batch_size,
            shard_size=shard_size,
            hnsw_m=hnsw_m,
            ef_construction=ef_construction,
            ef_search=ef_search,
            progress=progress,
            max_words=max_words,
            nlist=nlist,
            pq_m=pq_m,
            nprobe=nprobe,
            overwrite=overwrite,
            hnsw_transform=hnsw_transform.value,
            rerank=rerank,
            device=device,
            score_scale=score_scale,
        )
    except (ValueError, OSError) as e:
        raise _fail(str(e)) from None
    typer.echo(
        f"built index {manifest.name!r} ({manifest.index_type}, {manifest.count} passages, "
        f"dim {manifest.dim}) in {manifest.build_seconds:.1f}s -> {out}"
    )


class EmbeddingsFormat(StrEnum):
    auto = "auto"
    pickle = "pickle"
    parquet = "parquet"
    arrow = "arrow"


@app.command("import")
def import_(
    embeddings: Annotated[
        list[Path],
        typer.Argument(help="Embedding files: DPR pickle shards or wiki_dpr parquet/arrow"),
    ],
    name: Annotated[str, typer.Option(help="Index name recorded in the manifest")],
    out: Annotated[Path, typer.Option(help="Index directory to create")],
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
    hnsw_m: Annotated[int, typer.Option(min=2)] = 32,
    ef_construction: Annotated[int, typer.Option(min=1)] = 128,
    ef_search: Annotated[int, typer.Option(min=1)] = 128,
    hnsw_transform: Annotated[
        HnswTransform, typer.Option(help="hnsw: native inner product or DPR's MIPS->L2")
    ] = HnswTransform.none,
    nlist: Annotated[int | None, typer.Option(min=1, help="ivfpq: inverted lists")] = None,
    pq_m: Annotated[int | None, typer.Option(min=1, help="ivfpq: PQ sub-quantizers")] = None,
    nprobe: Annotated[int, typer.Option(min=1, help="ivfpq: lists probed per query")] = 16,
    rerank: Annotated[
        int, typer.Option(min=0, help="Re-rank k*N candidates exactly (approximate types)")
    ] = 0,
    score_scale: Annotated[
        float, typer.Option(help="Multiply scores by this (1: DPR's raw inner products)")
    ] = 1.0,
    overwrite: Annotated[bool, typer.Option(help="Replace an existing index at --out")] = False,
    progress: Annotated[bool, typer.Option(help="Show progress bars")] = True,
) -> None:
    """Build an index from DPR passages + precomputed embeddings, without encoding
    (resumes an interrupted import of the same files)."""
    from openbook.index.importer import import_embeddings

    if type is IndexType.bm25:
        raise _fail("bm25 takes no embeddings; use a dense --type")
    try:
        manifest = import_embeddings(
            passages,
            embeddings,
            out,
            name=name,
            doc_encoder=doc_encoder,
            query_encoder=query_encoder,
            index_type=type.value,
            embeddings_format=format.value,
            batch_size=batch_size,
            shard_size=shard_size,
            hnsw_m=hnsw_m,
            ef_construction=ef_construction,
            ef_search=ef_search,
            hnsw_transform=hnsw_transform.value,
            nlist=nlist,
            pq_m=pq_m,
            nprobe=nprobe,
            rerank=rerank,
            score_scale=score_scale,
            overwrite=overwrite,
            progress=progress,
        )
    except (ValueError, OSError) as e:  # EmbeddingsError is a ValueError
        raise _fail(str(e)) from None
    typer.echo(
        f"imported index {manifest.name!r} ({manifest.index_type}, {manifest.count} passages, "
        f"dim {manifest.dim}) in {manifest.build_seconds:.1f}s -> {out}"
    )


@app.command()
def info(
    path: Annotated[Path, typer.Argument(help="Index directory")],
    verify: Annotated[bool, typer.Option(help="Re-hash every file against the manifest")] = False,
) -> None:
    """Print an index's manifest as JSON (optionally verifying checksums)."""
    from openbook.index.loaded import open_index
    from openbook.index.manifest import MANIFEST, IndexLoadError, Manifest

    try:
        if not path.is_dir():
            raise IndexLoadError(f"{path}: index directory not found")
        if verify:
            open_index(path, verify=True).close()
        manifest = Manifest.from_file(path / MANIFEST)
    except (IndexLoadError, OSError) as e:
        raise _fail(str(e)) from None
    typer.echo(json.dumps(asdict(manifest), indent=2, sort_keys=True))
    if verify:
        typer.echo("verified: ok", err=True)


@app.command()
def search(
    path: Annotated[Path, typer.Argument(help="Index directory")],
    queries: Annotated[list[str], typer.Argument(help="Query text(s)")],
    k: Annotated[int, typer.Option("-k", min=1)] = 5,
) -> None:
    """Search an index from the command line (for eyeballing results)."""
    from openbook.index.loaded import open_index
    from openbook.index.manifest import IndexLoadError

    try:
        with open_index(path, verify=False) as idx:
            results = idx.search(queries, k)
    except (IndexLoadError, ValueError, OSError) as e:
        raise _fail(str(e)) from None
    for q, hits in zip(queries, results, strict=True):
        typer.echo(f"# {q}")
        for rank, p in enumerate(hits, 1):
            snippet = p.text if len(p.text) <= 100 else p.text[:97] + "..."
            typer.echo(f"{rank:>3} {p.score:9.4f}  {p.id}  [{p.title}] {snippet}")


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
    from openbook.index.shard import split_index

    try:
        paths = split_index(src, shards, out_root, progress=progress)
    except (ValueError, OSError) as e:  # IndexLoadError is a ValueError
        raise _fail(str(e)) from None
    for p in paths:
        typer.echo(str(p))
    typer.echo(f"serve shard i with OPENBOOK_INDEX_ROOT={out_root}/shard-<i>", err=True)


if __name__ == "__main__":
    app()
