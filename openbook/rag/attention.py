"""Prompt attention on the CPU in reduced precision as plain matrix products.

Why: on a CPU with native bf16 arithmetic (AVX512-BF16, AMX-BF16) torch's CPU flash-attention
kernel is the slowest part of a prefill. On the default generator's prompt shapes (Gemma 3 270M,
5 rows of ~130 tokens after a 363-token prefix) it ran at ~150 GFLOP/s on a 2-core AVX512-BF16
machine, while bf16 matrix products ran at ~600: attention was a third of the prefill for a sixth
of its arithmetic. Two batched matrix products and a float32 softmax take half the time.

Scope (:func:`use_matmul_attention`): models running in bf16/fp16 on the CPU only. float32 keeps
transformers' own ``sdpa``, so the exactness tests and every float32 result stay bit-identical to
transformers; a decoding step (one query position) and anything without a mask also go to
``sdpa``, which is as fast there.

Shapes: query (B, H, q, D); key, value (B, Hkv, S, D) with H = g * Hkv (grouped-query attention:
query head h reads key/value head h // g); attention_mask additive (B or 1, 1 or H, q, S) in the
model's dtype or boolean (True: attend). Returns (B, q, H, D), transformers' attention-function
contract. The g query heads that share a key/value head are multiplied as one (g * q, D) matrix,
so keys and values are never repeated. Scores are rounded to the model's dtype by the matrix
product (as transformers' ``eager`` attention does), then softmaxed in float32. Queries are
processed in chunks that keep the float32 scores under :data:`MAX_SCORE_BYTES`, so a long prompt
cannot allocate a q x S matrix per head at once.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "openbook_matmul"
MAX_SCORE_BYTES = 16 * 2**20  # float32 scores of one query chunk, all rows and heads
# Peak bytes per (query, key) pair and head inside one chunk: the scores in the model's dtype
# (at most 4 bytes), in float32, their softmax in float32, and the weights in the model's dtype.
MATMUL_SCORE_BYTES = 4 + 4 + 4 + 4


def use_matmul_attention(model: PreTrainedModel) -> bool:
    """Switch ``model`` to this attention where it pays (CPU, bf16/fp16, currently ``sdpa``);
    returns whether it did."""
    params = next(model.parameters())
    if params.device.type != "cpu" or params.dtype == torch.float32:
        return False
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    model.set_attn_implementation(NAME)
    return True


def matmul_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers' attention-function signature; see the module doc for shapes."""
    q_len = query.shape[2]
    if (
        q_len == 1
        or attention_mask is None
        or module.training
        or kwargs.get("output_attentions", False)
        or kwargs.get("position_bias") is not None
        or kwargs.get("cache") is not None
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, **kwargs
        )
    batch, heads, _, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    group = heads // kv_heads
    scale = dim**-0.5 if scaling is None else scaling
    softcap = kwargs.get("softcap")
    # (B, Hkv, g, q, S) view of a mask over (B, 1 or H, q, S)
    mask = attention_mask.reshape(attention_mask.shape[0], -1, 1, q_len, kv_len)
    if mask.shape[1] != 1:
        mask = mask.reshape(mask.shape[0], kv_heads, group, q_len, kv_len)
    keys_t = key.transpose(-1, -2)  # (B, Hkv, D, S)
    out = torch.empty(batch, q_len, heads, dim, dtype=value.dtype, device=value.device)
    per_query = batch * heads * kv_len * 4
    chunk = max(1, min(q_len, MAX_SCORE_BYTES // per_query))
    for start in range(0, q_len, chunk):
        stop = min(q_len, start + chunk)
        n = stop - start
        # (B, Hkv, g * n, D): the query heads of one key/value head stacked
        q = query[:, :, start:stop].reshape(batch, kv_heads, group * n, dim)
        scores = torch.matmul(q, keys_t).view(batch, kv_heads, group, n, kv_len).float()
        scores.mul_(scale)  # in place from here: MATMUL_SCORE_BYTES
        if softcap is not None:
            scores.div_(softcap).tanh_().mul_(softcap)
        if mask.dtype == torch.bool:  # True: attend
            scores.masked_fill_(~mask[:, :, :, start:stop], torch.finfo(scores.dtype).min)
        else:
            scores.add_(mask[:, :, :, start:stop])
        weights = torch.softmax(scores, dim=-1).to(value.dtype)
        del scores
        ctx = torch.matmul(weights.view(batch, kv_heads, group * n, kv_len), value)
        # (B, Hkv, g, n, D) -> (B, n, H, D)
        out[:, start:stop] = ctx.view(batch, heads, n, dim).transpose(1, 2)
    return out, None


AttentionInterface.register(NAME, matmul_attention_forward)
# transformers builds the masks this attention receives as it builds sdpa's (without a mask
# function of its own, a model would get no mask at all).
AttentionMaskInterface.register(NAME, sdpa_mask)
