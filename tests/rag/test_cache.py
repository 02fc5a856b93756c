"""Key/value cache rows (openbook/rag/cache.py): growing in place without a view ever changing
under its holder, and joining with a reorder in one copy."""

from __future__ import annotations

import copy

import torch
from transformers.cache_utils import DynamicCache

from openbook.rag import cache as rows_module
from openbook.rag.cache import GrowingLayer, growing, join_rows, select_rows


def _kv(rows: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (rows, 2, length, 4)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _cache(rows: int, length: int, seed: int = 0, layers: int = 2) -> DynamicCache:
    cache = DynamicCache()
    for i in range(layers):
        cache.update(*_kv(rows, length, seed + i), i)
    return cache


def _tensors(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


def test_growing_appends_what_concatenation_gives():
    plain, grown = _cache(3, 5), _cache(3, 5)
    growing(grown)
    assert all(type(layer) is GrowingLayer for layer in grown.layers)
    for step in range(2 * rows_module.GROWTH_SLOTS + 3):  # past the spare slots, twice
        for i in range(2):
            k, v = _kv(3, 1, 100 * step + i)
            a = plain.update(k, v, i)
            b = grown.update(k, v, i)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert grown.get_seq_length() == plain.get_seq_length() == 5 + 2 * rows_module.GROWTH_SLOTS + 3


def test_a_copy_that_appends_second_never_overwrites_the_first():
    """Two forks of one grown cache (copy.copy, as share_rows and forks make) append different
    tokens: each sees its own, and the views taken before stay unchanged."""
    base = _cache(2, 4)
    growing(base)
    base.update(*_kv(2, 1, 7), 0)  # now a view of a buffer with room
    a = copy.copy(base)
    a.layers = [copy.copy(x) for x in base.layers]
    b = copy.copy(base)
    b.layers = [copy.copy(x) for x in base.layers]
    before = _tensors(base)
    ka, va = _kv(2, 1, 11)
    kb, vb = _kv(2, 1, 12)
    a.update(ka, va, 0)
    b.update(kb, vb, 0)
    assert torch.equal(a.layers[0].keys[:, :, -1:], ka)
    assert torch.equal(b.layers[0].keys[:, :, -1:], kb)
    assert torch.equal(a.layers[0].keys[:, :, :-1], before[0][0])
    assert torch.equal(b.layers[0].values[:, :, :-1], before[0][1])
    for layer, (k, v) in zip(base.layers, before, strict=True):
        assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
    # the first appended in place, the second (its view ended before the mark) copied
    assert a.layers[0].keys.data_ptr() == base.layers[0].keys.data_ptr()
    assert b.layers[0].keys.data_ptr() != base.layers[0].keys.data_ptr()


def test_selected_rows_and_expanded_views_are_copied_before_growing():
    base = _cache(3, 4)
    growing(base)
    picked = select_rows(base, torch.tensor([2, 0]))
    expected = picked.layers[0].keys.clone()
    k, v = _kv(2, 1, 5)
    out_k, _ = picked.update(k, v, 0)
    assert torch.equal(out_k, torch.cat([expected, k], dim=2))
    # an expanded prefix (stride 0 over rows) becomes rows of their own
    prefix = DynamicCache()
    prefix.update(*_kv(1, 3, 9), 0)
    layer = prefix.layers[0]
    wide = copy.copy(layer)
    wide.__class__ = GrowingLayer
    wide.keys, wide.values = layer.keys.expand(4, -1, -1, -1), layer.values.expand(4, -1, -1, -1)
    k, v = _kv(4, 1, 10)
    out_k, out_v = wide.update(k, v)
    assert torch.equal(out_k[:, :, :3], layer.keys.expand(4, -1, -1, -1))
    assert torch.equal(out_k[:, :, 3:], k) and torch.equal(out_v[:, :, 3:], v)


def test_join_with_a_destination_equals_join_then_select():
    caches = [_cache(2, 5, seed=1), _cache(3, 3, seed=2), _cache(1, 4, seed=3)]
    dest = torch.tensor([4, 0, 5, 1, 3, 2])
    joined = join_rows(caches)
    back = torch.empty_like(dest)
    back[dest] = torch.arange(len(dest))
    expected = select_rows(joined, back)
    ours = join_rows(caches, dest)
    for a, b in zip(ours.layers, expected.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def _grown(rows: int, length: int, seed: int) -> DynamicCache:
    """A cache as a running batch holds it: grown, after one decoding step."""
    cache = _cache(rows, length, seed)
    growing(cache)
    for i in range(2):
        cache.update(*_kv(rows, 1, seed + 50 + i), i)
    return cache


def test_rows_joining_or_leaving_are_copied_once_and_then_grow_in_place():
    """join_rows, select_rows and a beam reorder write a grown batch into a buffer with room:
    the next step appends into it (no second copy), and what it holds is what concatenation,
    left padding with zeros and row selection give."""
    running, joining = _grown(2, 5, seed=1), _cache(3, 3, seed=2)
    before = _tensors(running) + _tensors(joining)
    dest = torch.tensor([4, 0, 2, 1, 3])
    back = torch.empty_like(dest)
    back[dest] = torch.arange(5)  # output row j holds input row back[j]
    for joined, order in (
        (join_rows([running, joining]), torch.arange(5)),
        (join_rows([running, joining], dest), back),
    ):
        for i, layer in enumerate(joined.layers):
            padded = torch.cat([torch.zeros(3, 2, 3, 4), joining.layers[i].keys], dim=2)
            want = torch.cat([running.layers[i].keys, padded])[order]
            assert type(layer) is GrowingLayer and torch.equal(layer.keys, want)
            buffer = layer.keys.data_ptr()
            k, v = _kv(5, 1, 70 + i)
            out_k, _ = joined.update(k, v, i)
            assert out_k.data_ptr() == buffer  # appended in place: no copy of the join
            assert torch.equal(out_k, torch.cat([want, k], dim=2))
    # the sources are untouched
    for layer, (k, v) in zip(running.layers + joining.layers, before, strict=True):
        assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)

    # rows leaving, their leading padding dropped in the same copy
    kept = select_rows(running, torch.tensor([1]), start=2)
    for i, layer in enumerate(kept.layers):
        assert torch.equal(layer.keys, running.layers[i].keys[1:2, :, 2:])
        assert torch.equal(layer.values, running.layers[i].values[1:2, :, 2:])
        buffer = layer.keys.data_ptr()
        out_k, _ = kept.update(*_kv(1, 1, 80 + i), i)
        assert out_k.data_ptr() == buffer

    # a beam reorder
    reordered = _grown(3, 4, seed=5)
    want = [layer.keys[[2, 2, 0]] for layer in reordered.layers]
    rows_module.reorder_self_attention(reordered, torch.tensor([2, 2, 0]))
    for i, layer in enumerate(reordered.layers):
        assert torch.equal(layer.keys, want[i])
        buffer = layer.keys.data_ptr()
        out_k, _ = reordered.update(*_kv(3, 1, 90 + i), i)
        assert out_k.data_ptr() == buffer


def test_rows_in_any_order_or_span_are_the_rows_selected():
    """Consecutive rows (copied as one span) and rows in any other order (index_select) give
    the same as indexing, from any start slot."""
    cache = _grown(6, 5, seed=3)
    for rows in ([1, 2, 3], [0], [5], [4, 1], [0, 2, 3], [3, 3]):
        for start in (0, 2):
            picked = select_rows(cache, torch.tensor(rows), start)
            for layer, source in zip(picked.layers, cache.layers, strict=True):
                assert torch.equal(layer.keys, source.keys[rows][:, :, start:])
                assert torch.equal(layer.values, source.values[rows][:, :, start:])


def test_rows_leave_in_place_and_joining_rows_fill_their_room():
    """keep_in_place moves the rows after a leaving one up inside the buffers and
    join_in_place writes joining rows into the room left, left-padding the shorter side with
    zeros: the same keys/values as select_rows and join_rows, in the same buffer, and the next
    step appends in place."""
    for kept, start, joining_rows, joining_length in (
        ([0, 1, 2, 5], 0, 2, 3),  # rows leaving from the middle: a run moves up by 2
        ([1, 2, 3, 4, 5], 1, 1, 4),  # from the front, a leading slot dropped; a shorter joiner
        ([0, 1, 2, 3], 0, 2, 6),  # from the end (nothing moves); as long as the batch
        ([0, 2, 3, 4, 5], 2, 1, 6),  # one row moves; the joiner longer than what is kept
    ):
        running = _grown(6, 5, seed=11)  # 6 rows of 6 slots
        # from a twin: copying a layer marks its buffer as read by another holder
        want = select_rows(_grown(6, 5, seed=11), torch.tensor(kept), start)
        buffers = [layer._slots.keys.data_ptr() for layer in running.layers]
        assert rows_module.keep_in_place(running, torch.tensor(kept), start)
        for layer, wanted, buffer in zip(running.layers, want.layers, buffers, strict=True):
            assert torch.equal(layer.keys, wanted.keys)
            assert torch.equal(layer.values, wanted.values)
            assert layer._slots.keys.data_ptr() == buffer  # moved inside its own buffer
        joining = _cache(joining_rows, joining_length, seed=12)
        want = join_rows([want, joining])
        assert rows_module.join_in_place(running, joining)
        for i, (layer, wanted, buffer) in enumerate(
            zip(running.layers, want.layers, buffers, strict=True)
        ):
            assert torch.equal(layer.keys, wanted.keys)  # left padding with zeros included
            assert torch.equal(layer.values, wanted.values)
            assert layer._slots.keys.data_ptr() == buffer
            k, v = _kv(len(kept) + joining_rows, 1, 60 + i)
            out_k, out_v = running.update(k, v, i)
            assert out_k.data_ptr() == layer._slots.keys.data_ptr() + (
                layer._slots.start * out_k.stride(2) * out_k.element_size()
            )  # appended in place
            assert torch.equal(out_k, torch.cat([wanted.keys, k], dim=2))
            assert torch.equal(out_v, torch.cat([wanted.values, v], dim=2))


def test_rows_are_copied_where_there_is_no_room_in_place():
    """Each refusal leaves the cache as it was: rows joining beyond the room, longer than the
    slots before the kept ones allow, a buffer another holder reads, a buffer that would keep
    more room than SPARE_SHARE of what is kept, rows not increasing, plain layers."""
    running = _grown(4, 5, seed=21)
    assert not rows_module.join_in_place(running, _cache(1, 3, seed=22))  # no room yet
    assert not rows_module.keep_in_place(running, torch.tensor([0]))  # 4 rows kept for 1
    assert not rows_module.keep_in_place(running, torch.tensor([2, 1, 3]))
    before = _tensors(running)
    assert rows_module.keep_in_place(running, torch.tensor([0, 1, 3]))
    assert not rows_module.join_in_place(running, _cache(2, 3, seed=23))  # room for 1 row
    assert not rows_module.join_in_place(running, _cache(1, 7, seed=24))  # 6 slots held
    kept = [(k[[0, 1, 3]], v[[0, 1, 3]]) for k, v in before]
    for (k, v), (want_k, want_v) in zip(_tensors(running), kept, strict=True):
        assert torch.equal(k, want_k) and torch.equal(v, want_v)
    shared = _grown(4, 5, seed=25)
    copy.copy(shared.layers[0])  # another holder of layer 0's buffer
    assert not rows_module.keep_in_place(shared, torch.tensor([0, 1, 2]))
    assert not rows_module.keep_in_place(_cache(4, 5, seed=26), torch.tensor([0, 1, 2]))
    assert not rows_module.join_in_place(_cache(4, 5, seed=27), _cache(1, 3, seed=28))


def test_a_running_batch_copied_keeps_room_for_rows_to_join():
    """A running batch (growing layers) joined or selected by copying, or outgrowing its slots,
    gets buffers with ROOM_ROWS more rows and ROOM_SLOTS more slots before its own: the next
    request joins in place, even with a longer prompt, within SPARE_SHARE of what it holds;
    caches that do not grow (a prefill's) are copied exactly."""
    running, joining = _grown(10, 5, seed=31), _cache(2, 4, seed=32)
    joined = join_rows([running, joining])
    slots = joined.layers[0]._slots
    assert slots.keys.shape[0] == 12 + int(12 * rows_module.ROOM_ROWS)
    assert slots.start == int(6 * rows_module.ROOM_SLOTS)
    total = slots.keys.shape[0] * slots.keys.shape[2]
    assert total <= (1 + rows_module.ROOM_SHARE) * 12 * (slots.keys.shape[2] - slots.start)
    longer = _cache(2, 6 + slots.start, seed=33)
    want = join_rows([join_rows([running, joining]), longer])
    assert rows_module.join_in_place(joined, longer)
    for layer, wanted in zip(joined.layers, want.layers, strict=True):
        assert torch.equal(layer.keys, wanted.keys) and torch.equal(layer.values, wanted.values)
    # outgrowing its slots: the new buffers keep room too
    for step in range(rows_module.GROWTH_SLOTS + 1):
        for i in range(2):
            joined.update(*_kv(14, 1, 100 + 2 * step + i), i)
    grown = joined.layers[0]._slots
    assert grown.keys.data_ptr() != slots.keys.data_ptr() and grown.room
    assert grown.keys.shape[0] == 14 + int(14 * rows_module.ROOM_ROWS)
    kept = select_rows(joined, torch.tensor([0, 3, 5]))
    assert kept.layers[0]._slots.room
    plain = join_rows([_cache(2, 3, seed=34), _cache(2, 3, seed=35)]).layers[0]
    assert plain.keys.is_contiguous() and plain.keys.shape == (4, 2, 3, 4)
