"""The RAG-Token marginal (openbook/rag/marginalize.py): log sum_z p(z|x) p(y|x,z), as
torch.logsumexp over the passages gives it, for every shape the searches use, with padded
passage slots (prior -inf) and tokens no passage allows (-inf everywhere)."""

from __future__ import annotations

import pytest
import torch

from openbook.rag.marginalize import token_marginal


@pytest.mark.parametrize("shape", [(1, 5, 50), (1, 5, 3, 50), (2, 4, 2, 50), (1, 1, 50)])
def test_the_marginal_is_logsumexp_over_the_passages(shape):
    g = torch.Generator().manual_seed(0)
    lp = torch.log_softmax(3 * torch.randn(*shape, generator=g), dim=-1)
    prior = torch.log_softmax(torch.randn(shape[:2], generator=g), dim=-1)
    want = torch.logsumexp(lp + prior.reshape(*shape[:2], *[1] * (len(shape) - 2)), dim=1)
    torch.testing.assert_close(token_marginal(lp, prior), want, rtol=0, atol=1e-6)


def test_padded_slots_and_tokens_no_passage_allows():
    g = torch.Generator().manual_seed(1)
    lp = torch.log_softmax(torch.randn(1, 4, 30, generator=g), dim=-1)
    lp[:, :, 7] = -torch.inf  # no passage allows token 7
    lp[:, 1, 9] = -torch.inf  # one passage does not allow token 9
    prior = torch.log_softmax(torch.randn(1, 4, generator=g), dim=-1)
    prior[0, 3] = -torch.inf  # a padded slot
    got = token_marginal(lp, prior)
    assert got[0, 7] == -torch.inf
    assert not got.isnan().any()
    want = torch.logsumexp(lp + prior[..., None], dim=1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
