"""Draft models: directory round trip, referenced heads, legacy migration, incremental cache == parallel forward,
one sub-step layout, drafting through the protocol."""

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, MistralConfig, Qwen2Config

from specdraft import masks
from specdraft.config import ConfigError
from specdraft.models import KVCache, build_draft, draft_config_from_target, load_draft, save_draft
from specdraft.configs.draft import DraftConfig
from specdraft.models.layers import Chain

V, D, VD = 97, 64, 50
AUX = [1, 2, 3]


def draft_of(kind: str):
    torch.manual_seed(0)
    arch = "beagle" if kind == "beagle3" else kind
    feats = kind in ("eagle3", "beagle3")
    cfg = DraftConfig(arch=arch, vocab_size=V, hidden_size=D, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, intermediate_size=128, rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                      aux_layers=AUX if feats else [], draft_vocab_size=VD if feats else None)
    vocab = torch.randperm(V)[:VD].sort().values if feats else None
    return build_draft(cfg, embed=torch.randn(V, D), lm_head=torch.randn(V, D), vocab=vocab)


def inputs(t: int = 9, width: int = D):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(V, (2, t), generator=g)
    feats = torch.randn(2, t, width, generator=g)
    return ids, feats, torch.arange(t).expand(2, t)


def plain_forward(draft, ids, feats, pos):
    st = masks.plain(ids.shape[1])
    return draft(ids, pos, feats, st.query_index, st.cutoff, feats.new_zeros(2, ids.shape[1], 0, D))


@pytest.mark.parametrize("kind", ["beagle", "eagle", "eagle3", "beagle3"])
def test_save_load_round_trip_gives_identical_outputs(kind, tmp_path):
    draft = draft_of(kind)
    ids, feats, pos = inputs(width=draft.config.feature_size)
    with torch.no_grad():
        before = draft.logits(plain_forward(draft, ids, feats, pos))
    out = save_draft(draft, tmp_path / "d")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["arch"] == draft.config.arch
    stored = load_file(str(out / "model.safetensors"))
    assert not any("embed" in k or "lm_head_weight" in k or "teacher" in k for k in stored), "frozen heads were saved"
    with pytest.raises(ValueError, match="references its target"):
        load_draft(out)
    loaded = load_draft(out, heads=(draft.heads.embed_weight, draft.heads.teacher_weight if not draft.config.own_vocab
                                    else torch.randn(V, D)))
    assert type(loaded) is type(draft)
    with torch.no_grad():
        after = loaded.logits(plain_forward(loaded, ids, feats, pos))
    assert torch.equal(before, after)
    assert all(not b.requires_grad for b in loaded.heads.buffers())
    whole = load_draft(save_draft(draft, tmp_path / "whole", include_heads=True))  # self-contained directory
    with torch.no_grad():
        assert torch.equal(before, whole.logits(plain_forward(whole, ids, feats, pos)))


def test_draft_vocabulary_maps_are_saved_as_offsets(tmp_path):
    draft = draft_of("eagle3")
    stored = load_file(str(save_draft(draft, tmp_path / "d") / "model.safetensors"))
    ids = torch.arange(VD) + stored["heads.d2t"]
    assert torch.equal(ids, draft.heads.target_ids()) and bool((ids[1:] > ids[:-1]).all())
    assert torch.equal(stored["heads.t2d"].nonzero().flatten(), ids)
    # a fresh draft head starts from the target's rows of its vocabulary
    assert torch.equal(draft.heads.lm_head.weight, draft.heads.teacher_weight)


def test_specdraft_01_eagle_checkpoint_migrates(tmp_path):
    """A 0.1 EAGLE directory (embed/lm_head saved, input_layernorm on the fc output) loads as ``legacy``."""
    draft = draft_of("eagle")
    legacy = build_draft(_legacy_config(draft.config), embed=draft.heads.embed_weight,
                         lm_head=draft.heads.lm_head_weight)
    tensors = {k: v for k, v in legacy.state_dict().items()}
    tensors["embed.weight"] = draft.heads.embed_weight
    tensors["lm_head.weight"] = draft.heads.lm_head_weight
    out = tmp_path / "old"
    out.mkdir()
    config = {k: v for k, v in _plain(draft.config).items() if k not in
              ("legacy", "aux_layers", "draft_vocab_size", "target_hidden_size", "norm_before_residual")}
    (out / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    loaded = load_draft(out)
    assert loaded.config.legacy and hasattr(loaded, "input_layernorm")
    ids, feats, pos = inputs()
    with torch.no_grad():
        assert torch.equal(plain_forward(loaded, ids, feats, pos), plain_forward(legacy, ids, feats, pos))


def _plain(cfg):
    from specdraft.config import to_dict

    return to_dict(cfg)


def _legacy_config(cfg):
    return DraftConfig(**{**_plain(cfg), "legacy": True})


def test_load_draft_errors_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_draft(tmp_path)


@pytest.mark.parametrize("kind", ["beagle", "eagle", "eagle3"])
def test_incremental_cache_equals_parallel_forward(kind):
    """Prefill the cache with true states, then add one state per step: same as the plain mask."""
    draft = draft_of(kind)
    ids, feats, pos = inputs(width=draft.config.feature_size)
    t = ids.shape[1]
    with torch.no_grad():
        parallel = plain_forward(draft, ids, feats, pos)  # (B, T, d)
        states = draft.project(feats)  # (B, T, d)
        cache = KVCache()
        for p in range(1, t):
            if kind == "beagle":
                cache.append(draft.encode_states(states[:, p - 1 : p], pos[:, p - 1 : p]))
                h = draft.attend(ids[:, p : p + 1], pos[:, p : p + 1], cache.view(),
                                 torch.ones(2, 1, cache.length, dtype=torch.bool))
            else:  # slot p = (t_p, state p-1)
                x, kv = draft.encode_inputs(ids[:, p : p + 1], states[:, p - 1 : p], pos[:, p : p + 1])
                cache.append(kv)
                h = draft.attend(x, pos[:, p : p + 1], cache.view(), torch.ones(2, 1, cache.length, dtype=torch.bool))
            assert (h[:, 0] - parallel[:, p]).abs().max() < 1e-5, f"position {p}"
        if kind != "beagle":
            assert parallel[:, 0].abs().max() == 0, "position 0 has no state before it: no output"
        n = cache.length
        cache.crop(n - 2)
        assert cache.length == n - 2


@pytest.mark.parametrize("config_cls", [LlamaConfig, Qwen2Config, MistralConfig])
def test_draft_config_follows_target_geometry(config_cls):
    target = config_cls(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, intermediate_size=96,
                        vocab_size=50, num_hidden_layers=2, max_position_embeddings=512)
    cfg = draft_config_from_target(target, "beagle")
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (8, 2, 8)
    assert cfg.rope_parameters["rope_theta"] == target.rope_parameters["rope_theta"]
    assert cfg.max_position_embeddings == 512 and cfg.vocab_size == 50
    draft = build_draft(cfg)
    assert draft.q_proj.out_features == 64 and draft.k_proj.out_features == 16
    e3 = draft_config_from_target(target, "eagle3", aux_layers=[0, 1, 2], draft_vocab_size=40)
    assert e3.feature_size == 3 * 64 and build_draft(e3, vocab=torch.arange(40)).fc.in_features == 192


def test_configs_refuse_impossible_drafts():
    base = dict(vocab_size=V, hidden_size=D, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=128)
    with pytest.raises(ConfigError, match="aux_layers"):
        DraftConfig(arch="eagle3", draft_vocab_size=10, **base)
    with pytest.raises(ConfigError, match="draft_vocab_size"):
        DraftConfig(arch="eagle3", aux_layers=[1, 2, 3], **base)
    with pytest.raises(ConfigError, match="eagle3"):
        DraftConfig(arch="eagle", aux_layers=[1, 2, 3], **base)
    with pytest.raises(ConfigError, match="draft_vocab_size"):
        DraftConfig(arch="beagle", draft_vocab_size=V + 1, **base)


def test_shared_head_is_one_tensor_through_moves_and_casts():
    """With the target's own head, the teacher IS the lm_head: no second copy after .to() or a cast."""
    draft = draft_of("eagle")
    draft.to(torch.float64)
    assert draft.heads.teacher_weight is draft.heads.lm_head_weight
    from specdraft.models import set_frozen_dtype

    set_frozen_dtype(draft, torch.bfloat16)
    assert draft.heads.teacher_weight is draft.heads.lm_head_weight and draft.heads.embed_weight.dtype == torch.bfloat16
    assert sum(1 for _ in draft.heads.buffers()) == 2  # embed + lm_head, nothing else


@pytest.mark.parametrize("kind", ["beagle", "eagle", "eagle3", "beagle3"])
def test_per_query_extras_are_read_as_the_chain_that_wrote_them(kind):
    """A sub-step given its queries' drafted states per query (B, Q, E, d) computes what it computes
    from the chain of sub-steps that wrote them (one forward path)."""
    draft = draft_of(kind)
    ids, feats, pos = inputs(width=draft.config.feature_size)
    t = ids.shape[1]
    g = torch.Generator().manual_seed(5)
    chain = Chain(t)
    for v in range(2):  # sub-steps 1 and 2 wrote a state at every position p >= v
        written = torch.arange(v, t)
        chain.add(torch.randn(2, written.numel(), D, generator=g), written)
    q = torch.arange(2, t)  # sub-step 3 of an alignment: query p reads its states at p-2 and p-1
    cutoff = q - 1
    per_query = torch.stack([s[:, r] for s, r in zip(chain.states, chain.diagonal(q))], dim=2)  # (B, Q, 2, d)
    with torch.no_grad():
        from_tensor = draft(ids, pos, feats, q, cutoff, per_query)
        from_chain = draft(ids, pos, feats, q, cutoff, chain)
        from_rows = draft(ids, pos, feats, q, cutoff, chain.read(q))
    assert from_tensor.abs().max() > 0
    assert (from_tensor - from_chain).abs().max() < 1e-6
    assert (from_rows - from_chain).abs().max() < 1e-6


def test_drafting_asks_the_draft_and_never_names_an_architecture():
    """Drafting and the acceptance estimate go through the ``Draft`` protocol: no branch on ``arch``."""
    root = Path(__file__).resolve().parents[3] / "specdraft"
    files = sorted((root / "decoding").glob("*.py")) + [root / "acceptance.py"]
    for path in files:
        code = path.read_text()
        assert not re.search(r"\.arch\b|==\s*[\"'](beagle|eagle|eagle3)[\"']", code), f"{path.name} branches on arch"


@pytest.mark.parametrize("own", [False, True], ids=["target-head", "draft-vocab"])
def test_block_draft_round_trip_and_cache_drafting_equal_the_training_forward(own, tmp_path):
    """A DFlash draft saved and loaded drafts the same blocks; drafting a block over the per-layer context
    cache (built in two appends, as decoding builds it) equals the training forward's block at that anchor."""
    torch.manual_seed(0)
    cfg = DraftConfig(arch="dflash", vocab_size=V, hidden_size=D, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, intermediate_size=128, aux_layers=AUX, draft_vocab_size=VD if own else None,
                      num_layers=2, block_size=4, mask_token_id=V - 1)
    vocab = torch.randperm(V)[:VD].sort().values if own else None
    draft = build_draft(cfg, embed=torch.randn(V, D), lm_head=torch.randn(V, D), vocab=vocab).eval()
    ids, feats, pos = inputs(t=11, width=cfg.feature_size)
    anchors = torch.tensor([[3, 7], [5, -1]])
    with torch.no_grad():
        h = draft(ids, pos, feats, anchors)  # (2, 2, 4, d)
        out = save_draft(draft, tmp_path / "d")
        stored = load_file(str(out / "model.safetensors"))
        assert "layers.1.self_attn.k_norm.weight" in stored and "heads.norm.weight" in stored
        assert not any("embed" in k or "lm_head_weight" in k for k in stored)
        loaded = load_draft(out, heads=(draft.heads.embed_weight, torch.randn(V, D)))
        assert torch.equal(loaded(ids, pos, feats, anchors), h)
        states = draft.project(feats[:1])  # (1, T, d)
        caches = [KVCache() for _ in range(cfg.num_layers)]
        for lo, hi in ((0, 4), (4, 7)):  # the prompt, then one round's accepted tokens
            for cache, kv in zip(caches, draft.context_kv(states[:, lo:hi], pos[:1, lo:hi])):
                cache.append(kv)
        block = draft.draft_block(int(ids[0, 7]), 7, [c.view() for c in caches])  # (1, 4, d)
    assert (block[0] - h[0, 1]).abs().max() < 1e-5
