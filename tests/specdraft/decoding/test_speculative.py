"""Greedy speculative decoding reproduces vanilla greedy decoding token for token.

Both drafts, chain and EAGLE-2 trees under several settings, the Llama / Qwen2 / Mistral tiny
families and the toy target; random drafts (mostly rejections), an EAGLE draft that copies a
1-layer target (near-total acceptance) and an oracle stub draft (mixed acceptance) so long
accepted paths, bonus tokens and cache compaction are all exercised.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.specdraft.decoding.decoding_helpers import StubBlockDraft, StubDraft, tiny_draft, tiny_target
from specdraft.decoding import eos_token_ids, speculative_generate, vanilla_generate
from specdraft.configs.decode import DecodeConfig
from specdraft.evaluation.questions import render_prompt
from specdraft.decoding.metrics import first_mismatch
from specdraft.models import build_draft, draft_config_from_target
from specdraft.targets.loading import load_target_heads, load_target_model, load_tokenizer

CHAIN = DecodeConfig(mode="chain", gamma=3, max_new_tokens=30)
TREE = DecodeConfig(mode="tree", depth=4, topk=3, total_tokens=10, max_new_tokens=30)


def prompt(seed: int, n: int = 12, vocab: int = 128) -> list[int]:
    return torch.randint(vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_lossless(target, draft, ids, cfg, eos_ids=frozenset()):
    ref = vanilla_generate(target, ids, cfg, eos_ids)
    gen = speculative_generate(target, draft, ids, cfg, eos_ids)
    assert gen.tokens == ref.tokens, f"first difference at {first_mismatch(gen.tokens, ref.tokens)}"
    assert len(gen.tokens) == 1 + sum(gen.round_tokens)
    assert gen.rounds == len(gen.round_tokens) == len(gen.accepted)
    return gen


@pytest.mark.parametrize("cfg", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("arch", ["beagle", "eagle", "eagle3", "beagle3", "dflash", "dflash-vocab"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_greedy_lossless_random_drafts(family, arch, cfg):
    target = tiny_target(family, seed=0, logit_scale=4.0)
    draft = tiny_draft(target, arch)
    assert_lossless(target, draft, prompt(1), cfg)


@pytest.mark.parametrize(
    "cfg",
    [
        DecodeConfig(mode="tree", max_new_tokens=24),  # EAGLE-2 defaults: depth 6, top-k 10, 60 tokens
        DecodeConfig(mode="tree", depth=2, topk=8, total_tokens=16, max_new_tokens=24),
        DecodeConfig(mode="tree", depth=5, topk=2, total_tokens=5, max_new_tokens=24),
        DecodeConfig(mode="tree", depth=3, topk=4, total_tokens=40, max_new_tokens=24),
        DecodeConfig(mode="chain", gamma=1, max_new_tokens=24),
        DecodeConfig(mode="chain", gamma=7, max_new_tokens=24),
        DecodeConfig(mode="tree", depth=4, topk=3, total_tokens=10, concate=False, max_new_tokens=24),
    ],
    ids=["defaults", "wide", "narrow", "full", "gamma1", "gamma7", "no-concate"],
)
@pytest.mark.parametrize("arch", ["beagle", "eagle"])
def test_greedy_lossless_settings(arch, cfg):
    target = tiny_target("llama", seed=5, logit_scale=4.0)
    assert_lossless(target, tiny_draft(target, arch, seed=6), prompt(7), cfg)


def copying_eagle(target, noise: float = 0.0):
    """An EAGLE draft that IS a 1-layer Llama target: fc picks e(t) and the decoder layer is copied.
    The target's final norm only rescales each state, so the draft's argmax is the target's. It uses
    the specdraft 0.1 layout (``legacy``: an input norm on the fc output and a slot at position 0),
    which can copy a target layer exactly — and so also checks that such drafts still decode."""
    assert target.config.num_hidden_layers == 1
    draft = build_draft(
        dataclasses.replace(draft_config_from_target(target.config, "eagle"), legacy=True),
        embed=target.get_input_embeddings().weight,
        lm_head=target.lm_head.weight,
    )
    layer = target.model.layers[0]
    d = target.config.hidden_size
    with torch.no_grad():
        draft.fc.weight.zero_()
        draft.fc.weight[:, :d] = torch.eye(d) + noise * torch.randn(d, d, generator=torch.Generator().manual_seed(0))
        draft.fc.bias.zero_()
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(draft, name).weight.copy_(getattr(layer.self_attn, name).weight)
        for name in ("gate_proj", "up_proj", "down_proj"):
            getattr(draft.mlp, name).weight.copy_(getattr(layer.mlp, name).weight)
        draft.input_layernorm.weight.copy_(layer.input_layernorm.weight)
        draft.post_attention_layernorm.weight.copy_(layer.post_attention_layernorm.weight)
    return draft.eval()


@pytest.mark.parametrize(
    "cfg",
    [CHAIN, DecodeConfig(mode="tree", depth=4, topk=3, total_tokens=30, max_new_tokens=30)],
    ids=["chain", "full-tree"],
)
def test_copying_draft_is_accepted_and_still_lossless(cfg):
    target = tiny_target("llama", seed=8, logit_scale=4.0, num_hidden_layers=1)
    gen = assert_lossless(target, copying_eagle(target), prompt(9), cfg)
    if cfg.mode == "chain":  # the draft's top-1 path is the target's greedy path
        assert gen.accepted[:-1] == [cfg.gamma] * (gen.rounds - 1)
    else:  # the frontier keeps the best values, which need not contain the whole top-1 path
        assert sum(gen.round_tokens) / gen.rounds >= 3.0
    noisy = assert_lossless(target, copying_eagle(target, noise=0.3), prompt(9), cfg)
    assert 0 < sum(noisy.accepted) < sum(gen.accepted)


@pytest.mark.parametrize("cfg", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_oracle_stub_draft_with_real_targets(family, cfg):
    """Stub draft knowing the target's greedy continuation, wrong at every 4th position."""
    target = tiny_target(family, seed=2, logit_scale=4.0)
    ids = prompt(3)
    ref = vanilla_generate(target, ids, DecodeConfig(max_new_tokens=60))
    oracle = StubDraft(ids + ref.tokens + [0] * 20, 128, wrong=lambda p: p % 4 == 0)
    gen = assert_lossless(target, oracle, ids, cfg)
    assert sum(gen.round_tokens) / gen.rounds > 2.5


@pytest.mark.parametrize("cfg", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_oracle_stub_block_draft_with_real_targets(family, cfg):
    """A block draft knowing the target's greedy continuation, wrong at every 4th position: one block per
    round (a chain of gamma in chain mode, the block's 5 masked positions otherwise), still lossless."""
    target = tiny_target(family, seed=2, logit_scale=4.0)
    ids = prompt(3)
    ref = vanilla_generate(target, ids, DecodeConfig(max_new_tokens=60))
    oracle = StubBlockDraft(ids + ref.tokens + [0] * 20, 128, wrong=lambda p: p % 4 == 0)
    gen = assert_lossless(target, oracle, ids, cfg)
    assert max(gen.accepted) == (cfg.gamma if cfg.mode == "chain" else 3)  # wrong every 4th: at most 3 in a row
    assert sum(gen.round_tokens) / gen.rounds > 2.5
    perfect = assert_lossless(target, StubBlockDraft(ids + ref.tokens + [0] * 20, 128), ids, cfg)
    assert perfect.accepted[:-1] == [cfg.gamma if cfg.mode == "chain" else 5] * (perfect.rounds - 1)


def test_eos_and_max_new_tokens():
    target = tiny_target("llama", seed=0, logit_scale=4.0)
    draft = tiny_draft(target, "eagle")
    ids = prompt(1)
    ref = vanilla_generate(target, ids, DecodeConfig(max_new_tokens=30))
    eos = ref.tokens[10]
    for cfg in (CHAIN, TREE):
        gen = assert_lossless(target, draft, ids, cfg, frozenset({eos}))
        assert gen.stop == "eos" and gen.tokens[-1] == eos and eos not in gen.tokens[:-1]
        short = assert_lossless(target, draft, ids, DecodeConfig(mode=cfg.mode, max_new_tokens=1))
        assert short.tokens == ref.tokens[:1] and short.rounds == 0


def test_vanilla_matches_transformers_generate():
    target = tiny_target("qwen2", seed=4, logit_scale=4.0)
    ids = prompt(5)
    ours = vanilla_generate(target, ids, DecodeConfig(max_new_tokens=20)).tokens
    hf = target.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert ours == hf[0, len(ids) :].tolist()


@pytest.mark.parametrize("arch", ["beagle", "eagle", "dflash"])
def test_greedy_lossless_on_the_toy_target(toy_target_dir, arch):
    target = load_target_model(toy_target_dir)
    tokenizer = load_tokenizer(toy_target_dir)
    heads = load_target_heads(toy_target_dir)
    torch.manual_seed(0)
    blocks = dict(aux_layers=[0, 1], num_layers=2, block_size=4) if arch == "dflash" else {}
    draft = build_draft(draft_config_from_target(target.config, arch, **blocks), heads.embed, heads.lm_head).eval()
    eos = eos_token_ids(target, tokenizer)
    assert eos == {tokenizer.convert_tokens_to_ids("<|end|>")}
    ids = render_prompt(tokenizer, [{"role": "user", "content": "What is 3 plus 4?"}])
    for cfg in (CHAIN, TREE, DecodeConfig(mode="tree", max_new_tokens=30)):
        assert_lossless(target, draft, ids, cfg, eos)
