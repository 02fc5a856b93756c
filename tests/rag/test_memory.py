"""The admission estimate (openbook/rag/memory.py) is built from the model's shapes: its unit
costs must be those of the caches the backends really build, and it must grow with the work."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from openbook.rag import DecodingOptions, RagGenerator, memory
from openbook.rag.backends import BartEncoded
from openbook.rag.memory import RequestShape
from openbook_testkit.rag import QUESTION, make_passages


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
@torch.no_grad()
def test_causal_kv_bytes_per_token_are_those_of_the_cache(dirs, load, arch):
    gen = load(dirs.causal(arch))
    enc = gen.backend.encode([(QUESTION, make_passages(3))], 3)
    cache = enc.cache
    stored = _nbytes(t for layer in cache.layers for t in (layer.keys, layer.values))
    slots = enc.kv_pos.numel()  # rows x (prefix + padded prompt) cache slots
    assert stored == slots * gen.memory.kv_bytes_per_token
    assert gen.memory.prefix_tokens == gen.backend.prefix_len
    assert gen.memory.vocab == gen.backend.vocab_size


@torch.no_grad()
def test_bart_self_and_cross_attention_bytes_are_those_of_the_caches(dirs, load):
    gen = load(dirs.bart())
    enc = gen.backend.encode([(QUESTION, make_passages(3))], 3)
    assert isinstance(enc, BartEncoded)  # BART's own decoding, whose caches the model describes
    rows, enc_tokens = enc.mask.shape
    self_attention = _nbytes(t for kv in enc.cache for t in kv)  # one decoded token per row
    assert self_attention == rows * gen.memory.kv_bytes_per_token
    d_model = gen.model.config.d_model * next(gen.model.parameters()).element_size()
    cross = _nbytes(t for kv in enc.cross for t in kv)
    # cross_bytes_per_token also counts the encoder output kept per token
    assert cross == rows * enc_tokens * (gen.memory.cross_bytes_per_token - d_model)
    assert gen.memory.shared_cross


def test_the_estimate_grows_with_every_dimension_of_the_work(dirs, load):
    gen = load(dirs.causal("gemma3"))
    base = RequestShape(passages=5, beams=1, prompt_tokens=100, new_tokens=32)
    one = gen.memory.batch_bytes([base])
    for more in (
        RequestShape(10, 1, 100, 32),
        RequestShape(5, 4, 100, 32),
        RequestShape(5, 1, 200, 32),
        RequestShape(5, 1, 100, 64),
    ):
        assert gen.memory.batch_bytes([more]) > one
    assert gen.memory.batch_bytes([base, base]) > one
    assert gen.memory.batch_bytes([]) == 0


def test_request_shape_reads_the_longest_prompt(dirs, load):
    gen = load(dirs.causal("gemma3"))
    passages = make_passages(3)
    passages[1].text = passages[1].text + " Paris" * 40
    shape = gen.request_shape(QUESTION, passages, DecodingOptions(num_beams=2, max_new_tokens=7))
    lengths = [len(gen.backend.prompt_ids(QUESTION, p)) for p in passages]
    # (how many of those tokens a passage cache holds depends on what this shared generator
    # prefilled before: tests/rag/test_passage_cache.py checks it)
    assert shape == RequestShape(3, 2, max(lengths), 7, sum(lengths), shape.cached_tokens)


def test_requests_are_measured_with_tokenizers_of_their_own(dirs, load):
    """Measuring runs in request threads beside decoding; a fast tokenizer carries its padding
    and truncation settings as shared state, so the measuring twin must not share it."""
    for gen in (load(dirs.bart()), load(dirs.causal("gemma3"))):
        twin = gen._measuring
        assert twin.tokenizer is not gen.backend.tokenizer
        assert twin.tokenizer._tokenizer is not gen.backend.tokenizer._tokenizer
        assert twin.model is gen.backend.model  # no second copy of the weights


def test_measuring_beside_batched_decoding_never_breaks_its_padding(dirs, load):
    import threading

    gen = load(dirs.bart())
    passages = make_passages(4)
    for i, p in enumerate(passages):
        p.text = p.text + " Paris" * (5 * i)  # uneven inputs: the batch must pad them
    options = DecodingOptions(max_new_tokens=3)
    stop = threading.Event()
    errors: list[BaseException] = []

    def measure() -> None:
        while not stop.is_set():
            try:
                gen.request_shape(QUESTION, passages[:1], options)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

    threads = [threading.Thread(target=measure) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for _ in range(20):
            gen.generate_batch([(QUESTION, passages, options), (QUESTION, passages[:2], options)])
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[0]


def _cache_bytes(cache) -> int:
    """Bytes of a cache's tensors, each storage once (rows may be views of one buffer)."""
    storages = {}
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            if t is not None and t.numel():
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


@torch.inference_mode()
def test_the_estimate_counts_the_copy_a_join_makes_of_the_running_cache(dirs, load):
    """Joining a request to the running batch builds the joined cache while the old one is
    alive: the estimate holds both (CACHE_COPIES) beside every request's encoded cache."""
    gen = load(dirs.causal("gemma3"))
    engine = gen.engine()
    options = DecodingOptions(num_beams=2, max_new_tokens=6)
    requests = [(QUESTION, make_passages(3, seed)) for seed in (1, 2)]
    running = [engine.add(q, p, options) for q, p in requests[:1]]
    engine.step()
    running.append(engine.add(*requests[1], options))
    shapes = [gen.request_shape(q, p, options) for q, p in requests]
    joined = _cache_bytes(engine._state.cache)
    encoded = sum(_cache_bytes(r.enc.cache) for r in running)
    assert memory.CACHE_COPIES == 2
    assert gen.memory.batch_bytes(shapes) >= memory.CACHE_COPIES * joined + encoded


def test_reduced_precision_counts_the_models_own_logits_beside_the_float32_ones(dirs):
    """In bf16 the model's logits (and Gemma's soft-capping temporary) are bf16 tensors beside
    the float32 distributions: per decoding row, MODEL_LOGIT_COPIES x vocab x 2 bytes more."""
    path = dirs.causal("gemma3")
    full = RagGenerator.load(path, device="cpu", dtype="float32").memory
    half = RagGenerator.load(path, device="cpu", dtype="bfloat16").memory
    assert full.model_logit_bytes == 0
    assert half.model_logit_bytes == 2
    shape = RequestShape(passages=4, beams=2, prompt_tokens=50, new_tokens=8)
    logits_only = dataclasses.replace(half, model_logit_bytes=0)
    extra = half.batch_bytes([shape]) - logits_only.batch_bytes([shape])
    per_element = memory.MODEL_LOGIT_COPIES * 2
    scored = min(memory.SCORE_LOGIT_ELEMENTS, shape.rows * shape.passages * 8 * half.vocab)
    assert extra == per_element * (shape.rows * half.vocab + scored)


def test_a_drafted_step_counts_the_logits_of_the_positions_it_holds(dirs, load):
    """Drafting feeds 1 + draft positions per row. Where the backend runs its LM head only over
    the positions read (FedLogProbs), a step holds two positions' logits per row at most;
    where the model's forward gives every position's logits, all of them."""
    gen = load(dirs.causal("gemma3"))
    shape = RequestShape(passages=5, beams=1, prompt_tokens=60, new_tokens=16)
    assert gen.backend.defers_head()
    undrafted = gen.memory.batch_bytes([shape])
    gen.set_draft_tokens(8)
    try:
        deferred = gen.memory.batch_bytes([shape])
        dense = dataclasses.replace(gen.memory, head_deferred=False).batch_bytes([shape])
    finally:
        gen.set_draft_tokens(0)
    assert gen.memory.batch_bytes([shape]) == undrafted
    m = gen.memory
    logit_bytes = 4 * memory.LOGIT_COPIES + m.model_logit_bytes * memory.MODEL_LOGIT_COPIES
    row_logits = shape.rows * m.vocab * logit_bytes
    assert deferred - undrafted == row_logits  # one position more: the one the search keeps
    assert dense - undrafted == 8 * row_logits  # every drafted position
