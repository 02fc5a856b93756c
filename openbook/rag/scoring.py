"""Teacher-forced scoring of candidate answers under every passage of their request."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from openbook.rag.backends import Encoded, GeneratorBackend


def score_candidates(
    backend: GeneratorBackend,
    enc: Encoded,
    cands: list[list[list[int]]],
    ks: list[int],
    known: list[list[dict[int, Sequence[float]]]] | None = None,
) -> list[Tensor]:
    """log p(y_t | x, z, y_<t) for every candidate y of request i and passage z < ks[i].

    cands[i] is request i's candidate token lists. Returns per request a (C_i, ks[i], T_i) float32
    tensor, T_i the longest candidate of request i; entries past a candidate's end are undefined.
    known[i][c], when given, maps passages to candidate c's token log-probs already computed under
    them (e.g. by that passage's own search); those pairs are not scored again. All other pairs go
    through one (chunked) forward pass.
    """
    device = enc.first_logprobs.device
    widths = [max((len(c) for c in cs), default=0) for cs in cands]
    width = max(widths, default=0)
    rows: list[int] = []
    seqs: list[list[int]] = []
    dest: list[int] = []  # flat output row of every scored pair
    given: list[Sequence[float]] = []
    given_dest: list[int] = []
    at = 0
    for i, cs in enumerate(cands):
        for c, toks in enumerate(cs):
            have = known[i][c] if known is not None else {}
            for z in range(ks[i]):
                lps = have.get(z)
                if lps is not None and len(lps) == len(toks):
                    given.append(lps)
                    given_dest.append(at)
                else:
                    rows.append(i * enc.k + z)
                    seqs.append(toks)
                    dest.append(at)
                at += 1
    flat = torch.zeros(at, width, dtype=torch.float32, device=device)
    if given:
        vals = torch.zeros(len(given), width, dtype=torch.float32)
        for r, lps in enumerate(given):
            vals[r, : len(lps)] = torch.tensor(lps, dtype=torch.float32)
        flat[torch.tensor(given_dest, device=device)] = vals.to(device)
    if rows:
        padded = torch.full((len(seqs), width), backend.pad_token_id, dtype=torch.long)
        for r, toks in enumerate(seqs):
            padded[r, : len(toks)] = torch.tensor(toks, dtype=torch.long)
        lengths = [len(toks) for toks in seqs]
        scored = backend.score(enc, torch.tensor(rows, device=device), padded.to(device), lengths)
        flat[torch.tensor(dest, device=device)] = scored
    out: list[Tensor] = []
    at = 0
    for i, cs in enumerate(cands):
        n_rows = len(cs) * ks[i]
        out.append(flat[at : at + n_rows, : widths[i]].reshape(len(cs), ks[i], widths[i]))
        at += n_rows
    return out
