"""Processed distributions (spec §0.1): the rows both the draft samples from and verifiers see."""

import pytest
import torch

from workers.sampling import SamplingParams, process

LOGITS = torch.log(torch.tensor([0.1, 0.4, 0.2, 0.3]))


def test_each_row_gets_its_own_settings():
    logits = LOGITS.expand(5, 4)
    params = [
        SamplingParams(1.0),
        SamplingParams(0.5),
        SamplingParams(1.0, top_k=2),
        SamplingParams(1.0, top_p=0.6),  # 0.4 alone is < 0.6; with 0.3 it reaches 0.7
        SamplingParams(0.0),
    ]
    out = process(logits, params)
    p = torch.tensor([0.1, 0.4, 0.2, 0.3])
    assert torch.allclose(out[0], p)
    assert torch.allclose(out[1], p**2 / (p**2).sum())
    assert torch.allclose(out[2], torch.tensor([0.0, 4 / 7, 0.0, 3 / 7]))
    assert torch.allclose(out[3], torch.tensor([0.0, 4 / 7, 0.0, 3 / 7]))
    assert torch.equal(out[4], torch.tensor([0.0, 1.0, 0.0, 0.0]))


def test_greedy_ties_go_to_the_lowest_id_and_extra_dims_are_kept():
    logits = torch.tensor([[[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]]])  # [n=1, R=2, V]
    out = process(logits, [SamplingParams(0.0)])
    assert out.shape == logits.shape
    assert torch.equal(out[0].argmax(-1), torch.tensor([1, 0]))
    assert torch.equal(out.sum(-1), torch.ones(1, 2))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"temperature": -1.0}, "temperature"), ({"top_k": -1}, "top_k"), ({"top_p": 0.0}, "top_p")],
)
def test_bad_settings_are_refused(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
