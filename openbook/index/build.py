"""build_index: an index over passage files, the document encoder run over the passages.

Write side. What to build is an :class:`~openbook.index.spec.IndexSpec`, how to build it a
:class:`~openbook.index.spec.BuildOptions`; the stages, the partial directory, resuming and the
atomic publish are ``stages.py``'s (its docstring states the invariants), the encoder as a
vector source ``vectors.py``'s.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from openbook.index.manifest import Manifest
from openbook.index.spec import BuildOptions, IndexSpec
from openbook.index.stages import BuildSource, build_lock, check_inputs, stage_and_publish
from openbook.index.vectors import (
    VectorDonors,
    VectorSource,
    default_score_scale,
    document_encoder,
    encoder_source,
)


def build_index(
    inputs: list[Path],
    out_dir: Path,
    spec: IndexSpec,
    options: BuildOptions | None = None,
) -> Manifest:
    """Build ``spec`` over ``inputs`` at ``out_dir`` and return its manifest.

    A dense index also gets a BM25 view of the same passages (``bm25/``, manifest ``views``
    ``["dense", "bm25"]``: hybrid retrieval, :mod:`openbook.index.fusion`) unless
    ``spec.bm25`` is False; ``index_type="bm25"`` builds only that view.

    ``options.device`` (e.g. ``cuda``) runs the document encoder there; the default is the
    CPU. ``options.precision`` is the dtype it runs in
    (:func:`openbook.index.encoders.resolve_precision`: ``auto`` is float32 on the CPU,
    bfloat16 or float16 on CUDA). ``spec.score_scale`` None: :func:`default_score_scale`.
    """
    started = time.monotonic()
    options = options or BuildOptions()
    out_dir = Path(out_dir)
    inputs = [Path(p) for p in inputs]
    check_inputs(inputs, out_dir, options.overwrite)
    spec, source = encoded_source(inputs, spec, options)
    with build_lock(out_dir):
        return stage_and_publish(out_dir, spec, options, source, started)


def encoded_source(
    inputs: list[Path], spec: IndexSpec, options: BuildOptions
) -> tuple[IndexSpec, BuildSource]:
    """What ``build_index`` builds ``spec`` from (whichever engine it is written to): the
    passages of ``inputs`` and, for a dense spec, the document encoder run over them (or the
    donors' vectors, ``options.reuse_vectors_from``); ``spec`` with its ``score_scale``
    resolved (the encoder's default where it was None)."""
    source: VectorSource | None = None
    if spec.dense:
        doc_enc, q_name, precision = document_encoder(spec, options)
        donors = None
        if options.reuse_vectors_from:
            donors = VectorDonors.open(
                options.reuse_vectors_from, doc_enc, options.batch_size, precision
            )
        source = encoder_source(doc_enc, q_name, options.batch_size, precision, donors)
        if spec.score_scale is None:
            spec = replace(spec, score_scale=default_score_scale(doc_enc))
    elif spec.score_scale is None:
        spec = replace(spec, score_scale=default_score_scale(None))
    built = BuildSource(inputs=inputs, input_format=options.input_format, vectors=source)
    return spec, built
