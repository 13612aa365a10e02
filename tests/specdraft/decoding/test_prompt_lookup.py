"""Prompt-lookup decoding: the vectorised search against a slow explicit loop, hand-computed
proposals and τ on a stub target, greedy PLD == vanilla greedy on real tiny models, and lossless
speculative sampling (chi-square against the exact target distribution)."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch

import specdraft.decoding.speculative as speculative
from specdraft.config import ConfigError
from specdraft.decoding import prompt_lookup_generate, speculative_decode
from specdraft.configs.decode import DecodeConfig, PromptLookupConfig
from specdraft.decoding import eos_token_ids, vanilla_generate
from specdraft.evaluation.questions import render_prompt
from specdraft.decoding.metrics import alpha, first_mismatch, tau
from specdraft.decoding.prompt_lookup import PromptLookupDrafter, find_match, lookup_proposal
from specdraft.decoding.sampling import sample, target_probs
from specdraft.decoding.tree import chain_of_tokens
from specdraft.decoding.verify import Acceptance
from specdraft.targets.loading import load_target_model, load_tokenizer
from tests.specdraft.decoding.decoding_helpers import StubTarget, chi2_gof, exact_joint, tiny_target

# --------------------------------------------------------------------------- the search


def slow_proposal(context: list[int], gamma: int, max_ngram: int, min_ngram: int) -> list[int]:
    """The definition, literally: longest suffix n-gram, most recent earlier occurrence, copy on."""
    last = len(context) - 1
    for n in range(max_ngram, min_ngram - 1, -1):
        if n > last:
            continue
        suffix = context[last - n + 1 :]
        for end in range(last - 1, n - 2, -1):  # most recent first; the occurrence ends before `last`
            if context[end - n + 1 : end + 1] == suffix:
                out, ext = [], list(context)
                for j in range(gamma):  # LZ77-style copy: may read tokens it has just proposed
                    ext.append(ext[end + 1 + j])
                    out.append(ext[-1])
                return out
    return []


@pytest.mark.parametrize("vocab", [2, 3, 5, 40])
def test_vectorised_search_matches_the_slow_loop(vocab):
    rng = random.Random(vocab)
    for trial in range(300):
        context = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        max_ngram = rng.randrange(1, 6)
        min_ngram = rng.randrange(1, max_ngram + 1)
        gamma = rng.randrange(1, 9)
        got = lookup_proposal(np.array(context), gamma, max_ngram, min_ngram).tolist()
        assert got == slow_proposal(context, gamma, max_ngram, min_ngram), (context, gamma, max_ngram, min_ngram)


@pytest.mark.parametrize(
    "context,gamma,max_ngram,min_ngram,expected",
    [
        ([5], 3, 3, 1, []),  # nothing before the root
        ([1, 2, 3], 3, 3, 1, []),  # no repeat
        ([1, 2, 3, 4, 1, 2], 3, 3, 1, [3, 4, 1]),  # 2-gram [1, 2] at 0..1
        ([7, 7], 4, 3, 1, [7, 7, 7, 7]),  # period 1: copied on
        ([1, 2, 3, 1, 2, 3, 1], 5, 3, 1, [2, 3, 1, 2, 3]),  # 3-gram [2, 3, 1] ends at 3, period 3
        ([4, 5, 6, 4], 3, 3, 2, []),  # only a 1-gram matches, min_ngram 2
        ([4, 5, 6, 4], 3, 3, 1, [5, 6, 4]),
        ([1, 2, 9, 1, 3, 1], 2, 3, 1, [3, 1]),  # most recent 1 (at 3), not the earliest (at 0: [2, 9])
        ([1, 2, 9, 4, 2, 8, 1, 2], 2, 1, 1, [8, 1]),  # max_ngram 1: the most recent 2, not the 2-gram [1, 2]
        ([1, 2, 9, 4, 2, 8, 1, 2], 2, 2, 1, [9, 4]),  # max_ngram 2: the 2-gram [1, 2] at 0..1 wins
    ],
)
def test_proposals_by_hand(context, gamma, max_ngram, min_ngram, expected):
    assert lookup_proposal(np.array(context), gamma, max_ngram, min_ngram).tolist() == expected
    assert slow_proposal(context, gamma, max_ngram, min_ngram) == expected


def test_search_leaves_the_context_alone_and_reports_the_match():
    context = np.array([3, 1, 2, 3, 1, 2, 3])
    before = context.copy()
    assert find_match(context, 3, 1) == (3, 3)  # [1, 2, 3] ends at 3 (most recent earlier)
    assert find_match(context, 1, 1) == (1, 3)
    assert (context == before).all()


# --------------------------------------------------------------------------- stub target, exact τ

V = 16
# prompt = positions 0..9; the stub target's greedy continuation is SEQ[10:]
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
SEQ = PROMPT + [3, 4, 9, 10, 5, 6, 7, 11, 12, 12, 12, 12, 12, 12] + [12] * 20


def test_stub_target_proposals_and_tau_by_hand():
    """gamma 3, n-grams 3..1, 14 new tokens. The prefill emits 3 (position 10); then
    R1 suffix [1,2,3] matches 0..2 -> propose [4,5,6]; 4 accepted, 5 != 9 -> emits [4, 9]
    R2 root 9, R3 root 10: never seen before -> no proposal, plain steps emit 10, then 5
    R4 suffix [5] matches position 4 -> propose [6,7,8]; 6, 7 accepted, 8 != 11 -> [6, 7, 11]
    R5 root 11, R6 root 12 (first 12): no proposal -> 12, 12
    R7 suffix [12] matches position 18 (period 1) -> propose [12,12,12], all accepted + bonus 12
    -> 14 tokens in 7 rounds: round tokens [2,1,1,3,1,1,4], τ = 13/7, α = [3/3, 2/3, 1/2]."""
    target = StubTarget(SEQ, V)
    cfg = DecodeConfig(mode="chain", gamma=3, max_new_tokens=14)
    gen = prompt_lookup_generate(target, PROMPT, cfg, PromptLookupConfig(max_ngram=3, min_ngram=1))
    assert gen.tokens == SEQ[10:24] == vanilla_generate(target, PROMPT, cfg).tokens
    assert gen.round_tokens == [2, 1, 1, 3, 1, 1, 4] and gen.accepted == [1, 0, 0, 2, 0, 0, 3]
    assert tau(sum(gen.round_tokens), gen.rounds) == 13 / 7
    assert gen.depth_tried == [3, 3, 2] and gen.depth_accepted == [3, 2, 1]
    assert alpha(gen.depth_tried, gen.depth_accepted) == [1.0, 2 / 3, 0.5]
    # 2-grams at least: R1 as before; roots 9, 10, 5 ([10, 5] unseen) are plain steps -> 10, 5, 6;
    # [5, 6] matches 4..5 -> propose [7, 8, 1]: 7 accepted, 8 != 11 -> [7, 11]; [11, 12], [12, 12]
    # unseen -> 12, 12; [12, 12] now matches 18..19 -> [12, 12, 12], cut to the 3 tokens left
    strict = prompt_lookup_generate(target, PROMPT, cfg, PromptLookupConfig(max_ngram=3, min_ngram=2))
    assert strict.tokens == gen.tokens and strict.round_tokens == [2, 1, 1, 1, 2, 1, 1, 1, 3]
    assert tau(sum(strict.round_tokens), strict.rounds) == 13 / 9


def test_pld_gamma_defaults_to_the_drafts_depth():
    assert PromptLookupConfig().resolved_gamma(DecodeConfig(mode="chain", gamma=4)) == 4
    assert PromptLookupConfig().resolved_gamma(DecodeConfig(mode="tree", depth=6)) == 6
    assert PromptLookupConfig(gamma=2).resolved_gamma(DecodeConfig(mode="tree", depth=6)) == 2
    with pytest.raises(ConfigError, match="min_ngram"):
        PromptLookupConfig(max_ngram=1, min_ngram=2)


def test_a_drafter_that_never_proposes_is_vanilla_decoding():
    """The seam: root-only trees make every round a plain decode step (one forward per token)."""

    class Silent:
        max_depth = 1
        aux_layers = ()

        def start(self, prompt_ids, features, first_token):
            return [first_token]

        def propose(self, state, generator):
            return chain_of_tokens(state[-1], torch.empty(0, dtype=torch.long))

        def advance(self, state, tokens, features):
            state.extend(tokens)

    target = tiny_target("llama", seed=0, logit_scale=4.0)
    cfg = DecodeConfig(max_new_tokens=20)
    ref = vanilla_generate(target, PROMPT, cfg)
    gen = speculative_decode(target, Silent(), PROMPT, cfg)
    assert gen.tokens == ref.tokens and gen.rounds == ref.rounds == 19 and gen.round_tokens == [1] * 19


# --------------------------------------------------------------------------- greedy == vanilla


def prompts(vocab: int = 128) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(0)
    return {
        "random": torch.randint(vocab, (16,), generator=g).tolist(),
        "repeated": [5, 9, 17, 33, 2, 71] * 4,  # a prompt full of 1..3-gram matches
        "short": [3],
    }


@pytest.mark.parametrize(
    "pld",
    [PromptLookupConfig(), PromptLookupConfig(gamma=1), PromptLookupConfig(gamma=7, max_ngram=5, min_ngram=2)],
    ids=["defaults", "gamma1", "gamma7-ngram5..2"],
)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_pld_is_vanilla_greedy(family, pld):
    target = tiny_target(family, seed=3, logit_scale=4.0)
    cfg = DecodeConfig(mode="chain", gamma=4, max_new_tokens=48)
    for name, ids in prompts().items():
        ref = vanilla_generate(target, ids, cfg)
        gen = prompt_lookup_generate(target, ids, cfg, pld)
        assert gen.tokens == ref.tokens, f"{name}: first difference at {first_mismatch(gen.tokens, ref.tokens)}"
        assert len(gen.tokens) == 1 + sum(gen.round_tokens) and gen.rounds == len(gen.accepted)


def bigram_target(family: str):
    """A tiny HF model whose attention outputs are zeroed: the next token depends on the current
    token only, so greedy decoding cycles and every earlier occurrence predicts the continuation."""
    target = tiny_target(family, seed=3, logit_scale=4.0)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    return target


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_pld_accepts_almost_everything_on_a_repetitive_target(family):
    target = bigram_target(family)
    cfg = DecodeConfig(mode="chain", gamma=4, max_new_tokens=40)
    start = prompts()["random"]
    ids = start + vanilla_generate(target, start, DecodeConfig(max_new_tokens=40)).tokens  # its own cycle, twice
    ref = vanilla_generate(target, ids, cfg)
    gen = prompt_lookup_generate(target, ids, cfg)
    assert gen.tokens == ref.tokens
    assert gen.accepted == [4] * gen.rounds  # every proposal right: 5 tokens per forward (the last cut)
    assert gen.round_tokens[:-1] == [5] * (gen.rounds - 1) and tau(sum(gen.round_tokens), gen.rounds) > 4.5


def test_greedy_pld_on_the_toy_target_stops_at_eos(toy_target_dir):
    target = load_target_model(toy_target_dir)
    tokenizer = load_tokenizer(toy_target_dir)
    eos = eos_token_ids(target, tokenizer)
    cfg = DecodeConfig(mode="tree", depth=5, max_new_tokens=40)
    for text in ("What is 3 plus 4?", "Repeat after me: red blue red blue red blue red blue."):
        ids = render_prompt(tokenizer, [{"role": "user", "content": text}])
        ref = vanilla_generate(target, ids, cfg, eos)
        gen = prompt_lookup_generate(target, ids, cfg, eos_ids=eos)
        assert gen.tokens == ref.tokens and gen.stop == ref.stop
        assert len(gen.depth_tried) == 5  # gamma = the tree depth
    # an EOS inside an accepted proposal ends generation there
    ids = [5, 9, 17, 33, 2, 71] * 3
    target = tiny_target("llama", seed=3, logit_scale=4.0)
    ref = vanilla_generate(target, ids, DecodeConfig(max_new_tokens=30))
    stop = frozenset({ref.tokens[12]})
    ref = vanilla_generate(target, ids, DecodeConfig(max_new_tokens=30), stop)
    gen = prompt_lookup_generate(target, ids, DecodeConfig(mode="chain", gamma=6, max_new_tokens=30), eos_ids=stop)
    assert gen.tokens == ref.tokens and gen.stop == "eos" and gen.tokens[-1] in stop


# --------------------------------------------------------------------------- sampling is lossless

SV = 6
STEPS = 3
SAMPLE_PROMPT = [1, 4, 2, 5, 1, 4, 2, 5, 1]  # periodic: lookup proposes [4, 2, 5] first


def test_pld_sampling_matches_the_target_distribution():
    cfg = DecodeConfig(mode="chain", gamma=2, temperature=0.8, top_k=4, top_p=0.9, max_new_tokens=STEPS)
    target = tiny_target("llama", seed=21, logit_scale=12.0, vocab_size=SV)
    counts, tried, accepted = sample_pld(target, cfg, 1000)
    assert 0 < accepted < tried, "the test must see both accepted and rejected proposals"
    stat, df, p = chi2_gof(counts, exact_joint(target, cfg.sampling, SAMPLE_PROMPT, STEPS))
    assert df >= 10, "too few cells for a meaningful test"
    assert p > 1e-3, f"chi2={stat:.1f} df={df} p={p:.2e}: PLD samples do not follow the target"


def sample_pld(target, cfg: DecodeConfig, n: int) -> tuple[Counter, int, int]:
    gen = torch.Generator().manual_seed(11)
    counts, tried, accepted = Counter(), 0, 0
    for _ in range(n):
        out = prompt_lookup_generate(target, SAMPLE_PROMPT, cfg, generator=gen)
        counts[tuple(out.tokens)] += 1
        tried, accepted = tried + sum(out.depth_tried), accepted + sum(out.depth_accepted)
    return counts, tried, accepted


def test_the_test_rejects_accepting_lookups_without_the_target_probability(monkeypatch):
    """The tempting bug for deterministic proposals: accept x whenever the target allows it
    (p(x) > 0) instead of with probability p(x)."""
    target = tiny_target("llama", seed=21, logit_scale=12.0, vocab_size=SV)
    cfg = DecodeConfig(mode="chain", gamma=3, temperature=1.0, max_new_tokens=STEPS)

    def biased(tree, logits, sampling, generator, eos_ids=frozenset()):
        tokens, node, path = tree.tokens.tolist(), 0, []
        while node + 1 < tree.size and float(target_probs(logits[node], sampling)[tokens[node + 1]]) > 0:
            path.append(node + 1)
            node += 1
        return Acceptance(path, sample(target_probs(logits[node], sampling), generator), len(path))

    monkeypatch.setattr(speculative, "accept_sampling", biased)
    counts, _, _ = sample_pld(target, cfg, 500)
    _, _, p = chi2_gof(counts, exact_joint(target, cfg.sampling, SAMPLE_PROMPT, STEPS))
    assert p < 1e-6


def test_drafter_buffer_grows_past_its_first_capacity():
    drafter = PromptLookupDrafter(gamma=2)
    state = drafter.start(torch.tensor([[1, 2]]), torch.zeros(1, 2, 4), 3)
    for i in range(200):
        drafter.advance(state, [i % 7, 1], torch.zeros(1, 2, 4))
    assert state.length == 3 + 400 and state.context[:3].tolist() == [1, 2, 3]
    assert state.context[-4:].tolist() == [198 % 7, 1, 199 % 7, 1]
