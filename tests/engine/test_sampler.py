"""Sampler on synthetic logits: supports of top-k / top-p / min-p, penalties, seeds, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from flashpage.engine.outputs import Logprob
from flashpage.engine.sampler import (
    Sampler,
    SampleRow,
    apply_min_p,
    apply_penalties,
    apply_token_bitmask,
    apply_top_k_top_p,
)
from flashpage.engine.sampling_params import SamplingParams

V = 12
# p = [0.5, 0.3, 0.15, 0.05, ~0 ...]: known nucleus and min-p sets.
_PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05] + [1e-9] * (V - 4))
LOGITS = _PROBS.log()


def _draw(
    params: SamplingParams, n: int = 4000, logits: torch.Tensor = LOGITS, seed: int = 0
) -> torch.Tensor:
    s = Sampler(torch.device("cpu"), seed=seed)
    out = s.sample(logits.expand(n, -1).clone(), [SampleRow(params, (), ()) for _ in range(n)])
    return torch.tensor(out.token_ids)


def test_greedy_is_argmax() -> None:
    torch.manual_seed(0)
    x = torch.randn(7, V)
    out = Sampler(torch.device("cpu")).sample(x, [SampleRow(SamplingParams(temperature=0), (), ())] * 7)
    assert out.token_ids == x.argmax(-1).tolist()
    assert out.logprobs is None


def test_plain_sampling_matches_distribution() -> None:
    toks = _draw(SamplingParams(temperature=1.0), n=20000)
    freq = torch.bincount(toks, minlength=V).float() / len(toks)
    for i in range(4):
        sd = math.sqrt(_PROBS[i] * (1 - _PROBS[i]) / len(toks))
        assert abs(freq[i] - _PROBS[i]) < 5 * sd + 1e-3, (i, freq[i], _PROBS[i])


@pytest.mark.parametrize(
    ("params", "support"),
    [
        (SamplingParams(top_k=2), {0, 1}),
        (SamplingParams(top_k=3), {0, 1, 2}),
        (SamplingParams(top_p=0.75), {0, 1}),  # smallest set with mass >= 0.75
        (SamplingParams(top_p=0.9), {0, 1, 2}),
        (SamplingParams(min_p=0.2), {0, 1, 2}),  # p >= 0.2 * 0.5
        (SamplingParams(min_p=0.7), {0}),
        (SamplingParams(top_k=3, top_p=0.6), {0, 1}),  # nucleus of the renormalised top-3
    ],
)
def test_filter_supports_are_respected(params: SamplingParams, support: set[int]) -> None:
    toks = _draw(params)
    assert set(toks.tolist()) == support


def test_top_k_renormalises() -> None:
    toks = _draw(SamplingParams(top_k=2), n=20000)
    p0 = 0.5 / 0.8
    freq0 = (toks == 0).float().mean().item()
    assert abs(freq0 - p0) < 5 * math.sqrt(p0 * (1 - p0) / len(toks))


def test_filter_functions_directly() -> None:
    x = torch.stack([LOGITS, LOGITS.flip(0)])
    y = apply_top_k_top_p(x, torch.tensor([1, V]), torch.tensor([1.0, 0.75]))
    assert torch.isfinite(y[0]).nonzero().flatten().tolist() == [0]
    assert torch.isfinite(y[1]).nonzero().flatten().tolist() == [V - 2, V - 1]
    assert torch.equal(y[0, 0], x[0, 0])  # kept logits unchanged
    z = apply_min_p(x, torch.tensor([0.0, 0.5]))
    assert torch.isfinite(z[0]).all()
    assert torch.isfinite(z[1]).nonzero().flatten().tolist() == [V - 2, V - 1]


def test_penalties_follow_vllm_formulas() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    prompt = torch.tensor([[1, 5]])  # token 1 in the prompt (5 = padding)
    output = torch.tensor([[3, 3, 2, 5]])  # token 3 twice, token 2 once
    got = apply_penalties(
        logits.clone(), prompt, output, torch.tensor([0.5]), torch.tensor([0.25]), torch.tensor([2.0])
    )
    want = torch.tensor(
        [
            [
                2.0,  # unseen
                -1.0 * 2.0,  # prompt token, negative: multiplied
                0.5 / 2.0 - 0.25 * 1 - 0.5,  # output once: repetition, frequency, presence
                3.0 / 2.0 - 0.25 * 2 - 0.5,  # output twice
                -2.0,
            ]
        ]
    )
    torch.testing.assert_close(got, want)


def test_penalties_change_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0]])
    s = Sampler(torch.device("cpu"))
    base = s.sample(logits, [SampleRow(SamplingParams(temperature=0), [0], [])]).token_ids
    rep = s.sample(
        logits, [SampleRow(SamplingParams(temperature=0, repetition_penalty=1.5), [0], [])]
    ).token_ids
    freq = s.sample(
        logits, [SampleRow(SamplingParams(temperature=0, frequency_penalty=0.2), [], [0])]
    ).token_ids
    pres = s.sample(
        logits, [SampleRow(SamplingParams(temperature=0, presence_penalty=0.2), [0], [0, 0])]
    ).token_ids
    assert base == [0] and rep == [1] and freq == [1] and pres == [1]


def test_seed_reproducible_whatever_the_batch() -> None:
    torch.manual_seed(1)
    x = torch.randn(5, 50)
    s = Sampler(torch.device("cpu"), seed=123)
    p_seeded = SamplingParams(temperature=1.0, seed=7)
    p_free = SamplingParams(temperature=1.0)

    def run(position: int, batch: int, seed: int = 7) -> list[int]:
        g = s.make_generator(seed)
        toks = []
        for _ in range(20):
            rows = [SampleRow(p_free, (), ()) for _ in range(batch)]
            rows[position] = SampleRow(p_seeded, (), (), g)
            logits = x[:batch].clone()
            logits[position] = x[4]
            toks.append(s.sample(logits, rows).token_ids[position])
        return toks

    a = run(0, 1)
    assert run(3, 5) == a  # same seed, other position and batch
    assert run(2, 4) == a
    assert run(0, 1, seed=8) != a


def test_logprobs_are_raw_log_softmax() -> None:
    torch.manual_seed(2)
    x = torch.randn(3, 20)
    rows = [
        SampleRow(SamplingParams(temperature=0, logprobs=3), (), ()),
        SampleRow(SamplingParams(temperature=0), (), ()),
        SampleRow(SamplingParams(temperature=0.5, logprobs=0, seed=1), (), ()),
    ]
    out = Sampler(torch.device("cpu")).sample(x, rows)
    lp = x.log_softmax(-1)
    assert out.logprobs is not None and out.logprobs[1] is None
    d0 = out.logprobs[0]
    top3 = lp[0].topk(3).indices.tolist()
    assert set(d0) == set(top3) | {out.token_ids[0]} and len(d0) == 3
    for t, v in d0.items():
        assert v == pytest.approx(lp[0, t].item(), abs=1e-6)
    assert list(out.logprobs[2]) == [out.token_ids[2]]
    assert out.logprobs[2][out.token_ids[2]] == pytest.approx(lp[2, out.token_ids[2]].item(), abs=1e-6)


def test_logprobs_carry_ranks_and_stay_floats() -> None:
    x = torch.tensor([[0.0, 3.0, 1.0, 3.0, -1.0, 2.0]])
    row = SampleRow(SamplingParams(temperature=1.0, logprobs=3, logit_bias={4: 100}), (), ())
    out = Sampler(torch.device("cpu")).sample(x, [row])
    assert out.token_ids == [4]  # the bias makes token 4 all but certain
    d = out.logprobs[0]
    lp = x.log_softmax(-1)[0]
    assert all(isinstance(v, Logprob) and isinstance(v, float) for v in d.values())
    # Ranks are of the raw distribution (before the bias): ties share a rank.
    assert {t: v.rank for t, v in d.items()} == {1: 1, 3: 1, 5: 3, 4: 6}
    assert d[4].logprob == pytest.approx(lp[4].item()) and d[4] + 0.0 == pytest.approx(lp[4].item())


def test_logit_bias_and_banned_tokens() -> None:
    x = torch.zeros(3, V)
    x[:, 2] = 5.0
    rows = [
        SampleRow(SamplingParams(temperature=0, logit_bias={"7": 6.0}), (), ()),
        SampleRow(SamplingParams(temperature=0), (), (), banned=(2, V + 5)),  # ids past V are ignored
        SampleRow(SamplingParams(temperature=0, logit_bias={2: -100}), (), ()),
    ]
    out = Sampler(torch.device("cpu")).sample(x.clone(), rows)
    assert out.token_ids[0] == 7
    assert out.token_ids[1] != 2 and out.token_ids[2] != 2
    # Random rows never draw a banned token (0 and 1 hold 80% of the mass).
    s = Sampler(torch.device("cpu"), seed=0)
    many = s.sample(
        LOGITS.expand(500, -1).clone(), [SampleRow(SamplingParams(), (), (), banned=(0, 1))] * 500
    )
    assert not {0, 1} & set(many.token_ids)


def test_token_bitmask_masks_exactly_the_zero_bits() -> None:
    v = 70  # three 32-bit words, the last one partial
    torch.manual_seed(0)
    allowed = torch.rand(2, v) < 0.3
    allowed[:, 5] = True
    bits = torch.zeros(2, 96, dtype=torch.int64)
    bits[:, :v] = allowed.long()
    words = (bits.view(2, 3, 32) << torch.arange(32)).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # as int32 bit patterns
    x = torch.randn(2, v)
    y = apply_token_bitmask(x.clone(), words)
    assert torch.equal(torch.isinf(y), ~allowed)
    assert torch.equal(y[allowed], x[allowed])
    rows = [SampleRow(SamplingParams(temperature=1.0), (), ())] * 2
    for _ in range(5):
        toks = Sampler(torch.device("cpu")).sample(torch.randn(2, v), rows, words).token_ids
        assert all(allowed[i, t] for i, t in enumerate(toks))
