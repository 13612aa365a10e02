"""Temperature > 0: speculative sampling preserves the target distribution ("EAGLE-2: Faster Inference
of Language Models with Dynamic Draft Trees", §2), and the one top-p (nucleus) filter.

On a 6-token vocabulary the exact joint distribution of the first three generated tokens under
the warped target is enumerated; speculative samples (chain with sampled proposals, and a
deterministic top-k tree) must pass a Pearson chi-square goodness-of-fit test against it at a
fixed seed, and a deliberately biased acceptance rule must fail the same test.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

import specdraft.decoding.speculative as speculative
from specdraft.decoding import speculative_generate, vanilla_generate
from specdraft.configs.decode import DecodeConfig, SamplingConfig
from specdraft.decoding.sampling import keep_top_p, sample, target_probs
from specdraft.decoding.verify import Acceptance
from tests.specdraft.decoding.decoding_helpers import chi2_gof, chi2_sf, exact_joint, tiny_draft, tiny_target

V = 6
STEPS = 3
PROMPT = [1, 4, 2, 5, 0, 3]


def test_chi2_survival_function_against_tables():
    for stat, df, p in [(3.841459, 1, 0.05), (6.634897, 1, 0.01), (18.307038, 10, 0.05), (124.342113, 100, 0.05)]:
        assert chi2_sf(stat, df) == pytest.approx(p, rel=1e-5), (stat, df)
    for df in (2, 8, 30, 120):  # even df: Q = exp(-x/2) * sum_{k < df/2} (x/2)^k / k!
        for stat in (0.3, df / 2, df, 2 * df + 7):
            closed = math.exp(-stat / 2) * sum((stat / 2) ** k / math.factorial(k) for k in range(df // 2))
            assert chi2_sf(stat, df) == pytest.approx(closed, rel=1e-9, abs=1e-300), (stat, df)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 20, 0.6)])
def test_warpers_match_transformers(temperature, top_k, top_p):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    ours = target_probs(logits, SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p))
    x = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        x = TopKLogitsWarper(top_k)(None, x)
    if top_p < 1:
        x = TopPLogitsWarper(top_p)(None, x)
    assert torch.allclose(ours, x.softmax(-1), atol=1e-6)


@pytest.mark.parametrize("top_p,kept", [
    (0.75, [1, 1, 0, 0, 0]),  # exactly reached by the top two: no third token
    (0.7, [1, 1, 0, 0, 0]),
    (0.76, [1, 1, 1, 0, 0]),  # just past it: the third token is needed
    (0.3, [1, 0, 0, 0, 0]),  # the top token always stays
    (1.0, [1, 1, 1, 1, 1]),
])
def test_top_p_keeps_the_smallest_set_whose_mass_reaches_p(top_p, kept):
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625])  # (V,) exact in binary: no rounding at the boundary
    mask = keep_top_p(torch.stack([probs, probs.flip(0)]), top_p)  # (2, V): by probability, not position
    want = torch.tensor(kept, dtype=torch.bool)
    assert mask[0].tolist() == want.tolist() and mask[1].tolist() == want.flip(0).tolist()
    if top_p < 1:  # the same set as transformers' warper
        hf = TopPLogitsWarper(top_p)(None, probs.log()[None])[0].isfinite()  # (V,)
        assert mask[0].tolist() == hf.tolist()


def sampled_counts(target, draft, cfg: DecodeConfig, n: int, seed: int) -> Counter:
    gen = torch.Generator().manual_seed(seed)
    counts = Counter()
    for _ in range(n):
        tokens = speculative_generate(target, draft, PROMPT, cfg, generator=gen).tokens
        counts[tuple(tokens)] += 1
    return counts


@pytest.fixture(scope="module")
def models():
    target = tiny_target("llama", seed=21, logit_scale=12.0, vocab_size=V)
    drafts = {"beagle": tiny_draft(target, "beagle", seed=22), "eagle": tiny_draft(target, "eagle", seed=23),
              "eagle3": tiny_draft(target, "eagle3", seed=24, draft_vocab=4),  # 2 tokens it can never propose
              "dflash": tiny_draft(target, "dflash", seed=25)}
    return target, drafts


CASES = [
    ("eagle", DecodeConfig(mode="chain", gamma=2, temperature=1.0, max_new_tokens=STEPS)),
    ("eagle3", DecodeConfig(mode="chain", gamma=2, temperature=1.0, max_new_tokens=STEPS)),
    ("beagle", DecodeConfig(mode="tree", depth=2, topk=2, total_tokens=4, temperature=0.8, top_k=4, top_p=0.9,
                            max_new_tokens=STEPS)),
    ("dflash", DecodeConfig(mode="chain", gamma=2, temperature=0.8, top_k=4, max_new_tokens=STEPS)),
]


@pytest.mark.parametrize("arch,cfg", CASES, ids=["chain-sampled", "eagle3-draft-vocab", "tree-topk-warped",
                                                 "dflash-block-sampled"])
def test_speculative_sampling_matches_the_target_distribution(models, arch, cfg):
    target, drafts = models
    exact = exact_joint(target, cfg.sampling, PROMPT, STEPS)
    counts = sampled_counts(target, drafts[arch], cfg, n=1200, seed=7)
    stat, df, p = chi2_gof(counts, exact)
    assert df >= 10, "too few cells for a meaningful test"
    assert p > 1e-3, f"chi2={stat:.1f} df={df} p={p:.2e}: speculative samples do not follow the target"


def test_vanilla_sampling_matches_the_target_distribution(models):
    target, _ = models
    cfg = DecodeConfig(temperature=0.8, top_k=4, top_p=0.9, max_new_tokens=STEPS)
    gen = torch.Generator().manual_seed(3)
    counts = Counter(tuple(vanilla_generate(target, PROMPT, cfg, generator=gen).tokens) for _ in range(1000))
    _, _, p = chi2_gof(counts, exact_joint(target, cfg.sampling, PROMPT, STEPS))
    assert p > 1e-3


def test_the_test_rejects_a_biased_acceptance_rule(models, monkeypatch):
    """The classic bug: after a rejection, resample from p instead of the residual max(p - q, 0)."""
    target, drafts = models
    cfg = CASES[0][1]

    def biased(tree, logits, sampling, generator, eos_ids=frozenset()):
        tokens, node, path = tree.tokens.tolist(), 0, []
        while node + 1 < tree.size:  # a chain: the only child of node is node + 1
            p = target_probs(logits[node], sampling)
            q, x = tree.proposals[node + 1], tokens[node + 1]
            if torch.rand((), generator=generator) >= min(1.0, float(p[x] / q[x])):
                return Acceptance(path, sample(p, generator), len(path) + 1)
            path.append(node + 1)
            node += 1
        return Acceptance(path, sample(target_probs(logits[node], sampling), generator), len(path))

    monkeypatch.setattr(speculative, "accept_sampling", biased)
    counts = sampled_counts(target, drafts["eagle"], cfg, n=1000, seed=7)
    _, _, p = chi2_gof(counts, exact_joint(target, cfg.sampling, PROMPT, STEPS))
    assert p < 1e-6
