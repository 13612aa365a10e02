"""Reference tests: every masking / simulation trick against a slow explicit unrolling.

For each trained query the explicit path runs the draft step by step through its
incremental-drafting API (a KV cache, one query at a time), starting from the true
states before the query's chain and feeding back its own predicted states with the
true tokens (teacher forcing on tokens) — exactly what drafting does. The parallel
stage forward must give the same states and losses (fp32, < 1e-5), and the gradients of
``train_batch`` must equal those of the explicit losses: with the fed-back states
detached (late, align) or differentiated through the whole chain (ttt).

Losses here are the materialised formulas (full logits, softmax, gather), independent of
the fused chunked head in ``losses.head_loss``.
"""

from __future__ import annotations

import pytest
import torch

from specdraft import masks
from specdraft.batch import Batch
from specdraft.losses import feature_l1, soft_ce, topk_ce, weighted_mean
from specdraft.models import KV, KVCache, build_draft
from specdraft.configs.draft import DraftConfig
from specdraft.objectives import stage_note, substeps, train_batch
from specdraft.configs.stages import LossWeights, StageConfig

TOL = 1e-5
V, D, T, VD = 97, 64, 13, 61
AUX = [1, 3, 4]


def make_draft(kind: str, seed: int = 0):
    """kind: beagle | eagle | eagle3 | beagle3 (Beagle over EAGLE-3 features) | legacy (specdraft 0.1 EAGLE)."""
    torch.manual_seed(seed)
    arch = {"beagle3": "beagle", "legacy": "eagle"}.get(kind, kind)
    feats = kind in ("eagle3", "beagle3")
    cfg = DraftConfig(
        arch=arch, vocab_size=V, hidden_size=D, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=128, aux_layers=AUX if feats else [], draft_vocab_size=VD if feats else None,
        legacy=kind == "legacy",
    )
    vocab = torch.randperm(V)[:VD].sort().values if feats else None
    draft = build_draft(cfg, embed=torch.randn(V, D), lm_head=torch.randn(V, D) / D**0.5, vocab=vocab)
    with torch.no_grad():  # perturb the freshly initialised norms and the fc bias so none is the identity
        for name, p in draft.named_parameters():
            if "norm" in name or "layernorm" in name or name.endswith("fc.bias"):
                p.add_(0.1 * torch.randn_like(p))
    return draft


def make_batch(seed: int = 1, with_topk: bool = False, aux: bool = False) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(V, (2, T), generator=g)
    hidden = torch.randn(2, T, D, generator=g)
    valid = torch.ones(2, T, dtype=torch.bool)
    valid[1, 10:] = False
    loss_mask = torch.rand(2, T, generator=g) > 0.2
    loss_mask[:, :2] = False
    batch = Batch(ids, hidden, loss_mask & valid, valid)
    if with_topk:
        logits = torch.randn(2, T, V, generator=g)
        top = torch.log_softmax(logits, -1).topk(10, dim=-1)
        batch.topk_ids, batch.topk_logp = top.indices, top.values
    if aux:
        batch.aux_hidden = torch.randn(2, T, D * len(AUX), generator=g)
    return batch


def empty_kv(draft) -> KV:
    c = draft.config
    z = torch.zeros(1, c.num_key_value_heads, 0, c.head_dim)
    return KV(z, z)


def explicit_chain(draft, ids, states, root: int, last: int, concate: bool = True, detach: bool = True):
    """Draft positions root..last of one row, one query at a time, from the true ``states`` (T, d) < root.

    Returns the predicted state (1, 1, d) of every query root..last.
    """
    pos = lambda c: torch.tensor([[c]])  # noqa: E731
    fed = (lambda h: h.detach()) if detach else (lambda h: h)  # noqa: E731
    cache = KVCache()
    out = []
    if draft.config.arch == "beagle":
        if root > 0:
            cache.append(draft.encode_states(states[None, :root], torch.arange(root)[None]))
        for c in range(root, last + 1):
            kv = cache.view() if cache.length else empty_kv(draft)
            h = draft.attend(ids[None, c : c + 1], pos(c), kv, torch.ones(1, 1, kv.length, dtype=torch.bool))
            out.append(h)
            if concate:
                cache.append(draft.encode_states(fed(h), pos(c)))
        return out
    assert concate, "EAGLE drafting always feeds its own state back"
    if draft.config.legacy:  # slots 0..root, slot c from state c-1, a zero state at slot 0
        prev = torch.cat([torch.zeros(1, D), states[:root]])
        x, kv = draft.encode_inputs(ids[None, : root + 1], prev[None], torch.arange(root + 1)[None])
    else:  # slots 1..root
        assert root >= 1, "an EAGLE chain needs a true state before its root"
        x, kv = draft.encode_inputs(ids[None, 1 : root + 1], states[None, :root], torch.arange(1, root + 1)[None])
    cache.append(kv)
    x_q = x[:, -1:]
    for c in range(root, last + 1):
        if c > root:
            x_q, kv = draft.encode_inputs(ids[None, c : c + 1], fed(out[-1]), pos(c))
            cache.append(kv)
        h = draft.attend(x_q, pos(c), cache.view(), torch.ones(1, 1, cache.length, dtype=torch.bool))
        out.append(h)
    return out


def root_of(kind: str, p: int, step: int, window: int, offset: int) -> tuple[int, bool]:
    """Where the explicit chain for query p at this sub-step starts, and whether it concatenates."""
    if kind == "plain":
        return p, True
    if kind == "early":
        return int(masks.window_start(T, window, offset)[p]), False
    return p - step + 1, True  # late, align, ttt


def true_states(draft, batch: Batch, b: int) -> torch.Tensor:
    return draft.project(batch.aux_hidden[b] if draft.config.aux_layers else batch.hidden[b])  # (T, d)


def explicit_loss(draft, batch: Batch, qs: torch.Tensor, h: torch.Tensor, weights: LossWeights, live) -> torch.Tensor:
    """Loss from explicitly drafted states h (B, Q, d), written out term by term with full logits."""
    heads = draft.heads
    logp = torch.log_softmax(draft.logits(h).float(), -1)  # (B, Q, Vd)
    h_true = batch.hidden[:, qs]
    tgt = h_true @ heads.teacher_weight.T  # (B, Q, Vd): the target's logits over the output vocabulary
    scored = (batch.loss_mask & batch.valid)[:, qs] & (qs > 0)[None] & live[None]
    trained = scored.clone()
    if draft.config.own_vocab and batch.topk_ids is not None:
        trained &= heads.t2d[batch.topk_ids[:, qs, 0]]
    total = torch.zeros(())
    if weights.ce:
        total = total + weights.ce * weighted_mean(soft_ce(logp, tgt), trained)
    if weights.topk:
        if draft.config.own_vocab:
            top = torch.log_softmax(tgt, -1).topk(batch.topk_ids.shape[-1], dim=-1)
            ids, lp = top.indices, top.values
        else:
            ids, lp = batch.topk_ids[:, qs], batch.topk_logp[:, qs]
        total = total + weights.topk * weighted_mean(topk_ce(logp, ids, lp), trained)
    if weights.vloss:
        total = total + weights.vloss * weighted_mean(feature_l1(h, h_true), trained)
    return total


def explicit_states(draft, batch: Batch, step: masks.Step, kind: str, window: int, offset: int, detach: bool):
    """Explicit predicted states (B, Q, d) of one sub-step (zeros where the query has no input)."""
    out = torch.zeros(2, step.query_index.numel(), D)
    for b in range(2):
        states = true_states(draft, batch, b)
        for qi, p in enumerate(step.query_index.tolist()):
            root, concate = root_of(kind, p, step.index, window, offset)
            if not batch.valid[b, p] or (draft.config.needs_root_state and root < 1):
                continue
            out[b, qi] = explicit_chain(draft, batch.input_ids[b], states, root, p, concate, detach)[-1][0, 0]
    return out


CASES = [
    ("beagle", "plain", 0),
    ("beagle", "early", 0),
    ("beagle", "early", 3),
    ("beagle", "late", 0),
    ("beagle", "late", 2),
    ("beagle", "align", 0),
    ("beagle", "ttt", 0),  # Beagle reads a ttt chain's drafted states through the same Chain encodings
    ("eagle", "plain", 0),
    ("eagle", "late", 1),
    ("eagle", "align", 0),
    ("eagle", "ttt", 0),
    ("legacy", "align", 0),
    ("legacy", "ttt", 0),  # legacy slots: the chain's states gathered per query
    ("eagle3", "plain", 0),
    ("eagle3", "ttt", 0),  # the eagle3 recipe
    ("eagle3", "align", 0),  # the eagle3-hass recipe: HASS alignment + top-K distillation
    ("beagle3", "early", 1),  # the beagle3 recipe's two stages
    ("beagle3", "late", 2),
]


def stage_for(draft_kind: str, kind: str) -> StageConfig:
    feats = draft_kind in ("eagle3", "beagle3")
    weights = LossWeights(ce=1.0, topk=0.5, vloss=0.0 if feats else 10.0)
    return StageConfig(kind=kind, window=4, steps=3, noise_std=0.0, step_decay=0.8, loss=weights)


@pytest.mark.parametrize("draft_kind,kind,offset", CASES)
def test_stage_matches_explicit_unrolling(draft_kind, kind, offset):
    draft = make_draft(draft_kind)
    batch = make_batch(with_topk=True, aux=draft_kind in ("eagle3", "beagle3"))
    stage = stage_for(draft_kind, kind)
    seen = 0
    with torch.no_grad():
        for sub, st in zip(substeps(draft, batch, stage, offset=offset), _steps(stage, offset)):
            seen += 1
            explicit = explicit_states(draft, batch, st, kind, stage.window, offset, detach=True)
            live = st.cutoff >= 1 if draft.config.needs_root_state else torch.ones_like(st.cutoff, dtype=torch.bool)
            check = batch.valid[:, st.query_index] & live[None]
            diff = (sub.h_hat - explicit).abs()[check].max()
            assert diff < TOL, f"{draft_kind}/{kind} step {sub.step}: states differ by {diff}"
            ref = explicit_loss(draft, batch, st.query_index, explicit, stage.loss, live)
            assert abs(float(sub.loss) - float(ref)) < TOL, (sub.step, float(sub.loss), float(ref))
    assert seen == stage.num_substeps


def _steps(stage: StageConfig, offset: int):
    from specdraft.objectives import stage_steps

    return list(stage_steps(stage, T, offset, None))


@pytest.mark.parametrize("draft_kind,kind,offset", [c for c in CASES if c[1] in ("late", "align", "ttt")])
def test_gradients_match_explicit_unrolling(draft_kind, kind, offset):
    """train_batch's gradients == the gradients of the explicit per-chain losses: detached feedback for
    late/align (each step back-propagated alone), the whole unrolled chain for ttt."""
    batch = make_batch(with_topk=True, aux=draft_kind in ("eagle3", "beagle3"))
    stage = stage_for(draft_kind, kind)
    fast = make_draft(draft_kind)
    train_batch(fast, batch, stage, offset=offset)
    slow = make_draft(draft_kind)
    total = torch.zeros(())
    for st in _steps(stage, offset):
        explicit = explicit_states(slow, batch, st, kind, stage.window, offset, detach=kind != "ttt")
        live = st.cutoff >= 1 if slow.config.needs_root_state else torch.ones_like(st.cutoff, dtype=torch.bool)
        total = total + st.weight * explicit_loss(slow, batch, st.query_index, explicit, stage.loss, live)
    total.backward()
    for (name, p), (_, r) in zip(fast.named_parameters(), slow.named_parameters()):
        assert (p.grad - r.grad).abs().max() < TOL * max(1.0, float(r.grad.abs().max())), name


def test_ttt_differs_from_detached_alignment_in_gradients_only():
    batch = make_batch(with_topk=True, aux=True)
    grads = {}
    for kind in ("align", "ttt"):
        draft = make_draft("eagle3")
        grads[kind] = train_batch(draft, batch, stage_for("eagle3", kind)), draft.q_proj.weight.grad.clone()
    assert grads["align"][0]["loss"] == pytest.approx(grads["ttt"][0]["loss"], abs=1e-6)
    assert (grads["align"][1] - grads["ttt"][1]).abs().max() > 1e-6


def test_ttt_head_weight_gradient_kept_or_deferred_is_the_same(monkeypatch):
    """A ttt chain computes its trainable head's weight gradient in the forward while the k (V, d) buffers fit
    ``HEAD_GRAD_BYTES``, in the backward past it: the same loss and gradients either way."""
    import specdraft.objectives as objectives

    batch = make_batch(with_topk=True, aux=True)
    stage = stage_for("eagle3", "ttt")
    out = {}
    for budget in (1 << 30, 0):
        monkeypatch.setattr(objectives, "HEAD_GRAD_BYTES", budget)
        draft = make_draft("eagle3")
        assert objectives.defers_head_grad(draft, stage) == (budget == 0)
        out[budget] = train_batch(draft, batch, stage)["loss"], {n: p.grad for n, p in draft.named_parameters()}
    assert out[0][0] == pytest.approx(out[1 << 30][0], rel=1e-6)
    for name, grad in out[0][1].items():
        kept = out[1 << 30][1][name]
        assert (grad is None) == (kept is None), name
        assert grad is None or (grad - kept).abs().max() <= 1e-5 * max(1.0, float(kept.abs().max())), name
    assert not objectives.defers_head_grad(draft, stage_for("eagle3", "align"))  # each step back-propagated alone


def test_late_stage_trains_each_window_position_once_with_linear_weights():
    draft = make_draft("beagle")
    batch = make_batch()
    stage = StageConfig(kind="late", steps=4, noise_std=0.0)
    covered = []
    with torch.no_grad():
        for sub in substeps(draft, batch, stage, offset=1):
            assert sub.weight == 4 - sub.step + 1
            covered += sub.query_index.tolist()
    assert sorted(covered) == list(range(T))


def test_align_and_ttt_step_weights_decay():
    draft = make_draft("eagle")
    for kind in ("align", "ttt"):
        stage = StageConfig(kind=kind, steps=3, step_decay=0.5, noise_std=0.0)
        with torch.no_grad():
            weights = [s.weight for s in substeps(draft, make_batch(), stage)]
        assert weights == [1.0, 0.5, 0.25]


def test_the_stage_note_names_the_weights_the_logged_loss_sums():
    """A chained stage's logged ``loss`` is sum(beta_i * loss_step_i): Beagle's late stage (s = 4) logs about 10
    times a one-step loss, and the line printed when the stage starts says so, with those weights."""
    stages = [StageConfig(kind="early", window=4, noise_std=0.0), StageConfig(kind="late", steps=4, noise_std=0.0)]
    draft = make_draft("beagle")
    metrics = train_batch(draft, make_batch(), stages[1], offset=1)
    assert metrics["loss"] == pytest.approx(sum((5 - i) * metrics[f"loss_step{i}"] for i in range(1, 5)), rel=1e-6)
    note = stage_note(1, stages)
    assert note.startswith("stage 1 (late, 1 epoch): loss = sum of beta_i * loss_i over its 4 steps, beta = 4, 3, 2, 1 "
                           "(sum 10): about 10x a one-step loss"), note
    assert stage_note(0, stages) == "stage 0 (early, 1 epoch): loss = the loss of its one step"
    note = stage_note(0, [StageConfig(kind="ttt", steps=3, step_decay=0.5)])
    assert "beta = 1, 0.5, 0.25 (sum 1.75)" in note


def test_early_stage_rejects_eagle_clearly():
    for kind in ("eagle", "eagle3"):
        draft = make_draft(kind)
        with pytest.raises(ValueError, match="early"):
            next(substeps(draft, make_batch(aux=True), StageConfig(kind="early")))


def test_feature_drafts_refuse_vloss_and_need_aux_states():
    draft = make_draft("eagle3")
    with pytest.raises(ValueError, match="vloss"):
        next(substeps(draft, make_batch(aux=True), StageConfig(kind="plain", loss=LossWeights(vloss=1.0))))
    with pytest.raises(ValueError, match="aux_layers=eagle3"):
        next(substeps(draft, make_batch(aux=False), StageConfig(kind="plain")))


def test_query_without_keys_is_zero_attention_not_nan():
    draft = make_draft("beagle")
    batch = make_batch()
    with torch.no_grad():
        sub = next(substeps(draft, batch, StageConfig(kind="early", window=5, noise_std=0.0), offset=0))
    assert torch.isfinite(sub.h_hat).all()
    # the first window sees no state at all: its output is the no-attention block output
    e = draft.heads.embed(batch.input_ids[:, :5])
    no_attn = draft.mlp(draft.norm_mlp(e)) + e
    assert (sub.h_hat[:, :5] - no_attn).abs().max() < TOL


@pytest.mark.parametrize("draft_kind,kind", [("beagle", "early"), ("beagle", "late"), ("eagle", "align"),
                                             ("eagle", "late"), ("eagle3", "ttt"), ("beagle3", "late")])
def test_gradients_reach_only_draft_parameters(draft_kind, kind):
    draft = make_draft(draft_kind)
    stage = stage_for(draft_kind, kind)
    train_batch(draft, make_batch(with_topk=True, aux=True), stage, generator=torch.Generator().manual_seed(0))
    frozen = dict(draft.heads.named_buffers())
    assert "embed_weight" in frozen and all(not b.requires_grad for b in frozen.values())
    assert draft.heads.teacher_weight.numel() and not draft.heads.teacher_weight.requires_grad
    for name, p in draft.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{name} got no gradient"


def test_noise_is_seeded_and_changes_inputs():
    draft = make_draft("beagle")
    batch = make_batch()
    stage = StageConfig(kind="plain", noise_std=0.2)
    with torch.no_grad():
        a = next(substeps(draft, batch, stage, generator=torch.Generator().manual_seed(5))).h_hat
        b = next(substeps(draft, batch, stage, generator=torch.Generator().manual_seed(5))).h_hat
        c = next(substeps(draft, batch, StageConfig(kind="plain", noise_std=0.0))).h_hat
    assert torch.equal(a, b)
    assert (a - c).abs().max() > 1e-3


@pytest.mark.parametrize("draft_kind,kind", [("beagle", "late"), ("eagle", "align"), ("eagle3", "ttt")])
def test_seeded_training_is_bitwise_repeatable(draft_kind, kind):
    def run():
        draft = make_draft(draft_kind, seed=3)
        opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-3)
        g = torch.Generator().manual_seed(11)
        stage = stage_for(draft_kind, kind)
        losses = []
        for _ in range(3):
            opt.zero_grad()
            losses.append(train_batch(draft, make_batch(with_topk=True, aux=True), stage, generator=g)["loss"])
            opt.step()
        return losses, draft.state_dict()

    (l1, s1), (l2, s2) = run(), run()
    assert l1 == l2
    assert all(torch.equal(s1[k], s2[k]) for k in s1)


# --------------------------------------------------------------------------- block drafts (DFlash)

BLOCK = 4


def make_block_draft(kind: str = "dflash", seed: int = 0):
    """kind: dflash | dflash-vocab (own draft vocabulary) | beagle-dflash (no self-attention in the block)."""
    torch.manual_seed(seed)
    own = kind == "dflash-vocab"
    cfg = DraftConfig(arch="dflash", vocab_size=V, hidden_size=D, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, intermediate_size=128, aux_layers=AUX, draft_vocab_size=VD if own else None,
                      num_layers=2, block_size=BLOCK, mask_token_id=V - 1,
                      block_self_attention=kind != "beagle-dflash")
    vocab = torch.randperm(V)[:VD].sort().values if own else None
    draft = build_draft(cfg, embed=torch.randn(V, D), lm_head=torch.randn(V, D) / D**0.5, vocab=vocab)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return draft


def explicit_block(draft, ids: torch.Tensor, states: torch.Tensor, a: int) -> torch.Tensor:
    """The block anchored at ``a`` written out literally: the context is the states 0..a-1 (sliced, no mask),
    every layer's keys are [context keys ++ the block's own keys] in one plain softmax (GQA repeated by
    hand). Returns the final states (S, d) before the head's norm."""
    cfg, s = draft.config, draft.config.block_size
    tokens = torch.tensor([int(ids[a])] + [cfg.mask_token_id] * (s - 1))
    pos = torch.arange(a, a + s)[None]  # (1, S)
    ctx = draft.hidden_norm(states[None, :a])  # (1, a, d)
    x = draft.heads.embed(tokens)[None]  # (1, S, d)
    for layer in draft.layers:
        att = layer.self_attn
        h = layer.input_layernorm(x)
        q = att.queries(h, pos, draft.rotary)  # (1, H, S, Dh)
        ctx_kv = att.keys_values(ctx, torch.arange(a)[None], draft.rotary)
        k, v = ctx_kv.k, ctx_kv.v
        if cfg.block_self_attention:
            own = att.keys_values(h, pos, draft.rotary)
            k, v = torch.cat([k, own.k], 2), torch.cat([v, own.v], 2)
        rep = cfg.num_attention_heads // cfg.num_key_value_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # (1, H, L, Dh)
        w = torch.softmax((q @ k.transpose(-1, -2)) / cfg.head_dim**0.5, dim=-1)  # (1, H, S, L)
        o = (w @ v).transpose(1, 2).reshape(1, s, -1)
        x = x + att.o_proj(o)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return x[0]


def explicit_block_loss(draft, batch: Batch, blocks: masks.Blocks, h: torch.Tensor, weights: LossWeights,
                        decay: float) -> torch.Tensor:
    """Sum over blocks b, n and depths k of w_k * loss(row a+k-1) / sum of w_k, term by term with full logits."""
    heads, cfg = draft.heads, draft.config
    num, den = torch.zeros(()), torch.zeros(())
    for b in range(h.shape[0]):
        for n, a in enumerate(blocks.anchors[b].tolist()):
            for k in range(1, cfg.block_size):
                q = a + k - 1
                if a < 0 or q >= T or not (batch.loss_mask[b, q] and batch.valid[b, q] and q > 0):
                    continue
                if cfg.own_vocab and batch.topk_ids is not None and not heads.t2d[batch.topk_ids[b, q, 0]]:
                    continue  # scored, not trained: the draft cannot emit the target's top-1
                logp = torch.log_softmax(draft.logits(h[b, n, k][None]).float(), -1)  # (1, Vd)
                tgt = batch.hidden[b, q][None] @ heads.teacher_weight.T  # (1, Vd)
                term = weights.ce * soft_ce(logp, tgt)
                if weights.topk:
                    if cfg.own_vocab:
                        top = torch.log_softmax(tgt, -1).topk(batch.topk_ids.shape[-1], dim=-1)
                        tid, tlp = top.indices, top.values
                    else:
                        tid, tlp = batch.topk_ids[b, q][None], batch.topk_logp[b, q][None]
                    term = term + weights.topk * topk_ce(logp, tid, tlp)
                num = num + decay ** (k - 1) * term[0]
                den = den + decay ** (k - 1)
    return num / den


BLOCK_STAGE = StageConfig(kind="block", anchors=5, step_decay=0.8, noise_std=0.0, loss=LossWeights(ce=1.0, topk=0.5))


@pytest.mark.parametrize("kind", ["dflash", "dflash-vocab", "beagle-dflash"])
def test_block_stage_matches_an_explicit_per_block_loop(kind):
    """The block stage's one forward (every block of every row at once, one mask) == each block drafted on its
    own from the sliced context: states, the weighted loss and its gradients (fp32, < 1e-5)."""
    from specdraft.objectives import block_substep, prepare_targets

    batch = make_batch(with_topk=True, aux=True)
    fast, slow = make_block_draft(kind), make_block_draft(kind)
    targets = prepare_targets(fast, batch, BLOCK_STAGE.loss)
    blocks = masks.sample_blocks(targets.scored, BLOCK, BLOCK_STAGE.anchors, torch.Generator().manual_seed(4))
    assert (blocks.anchors >= 0).sum() >= 8, "too few blocks for a meaningful test"
    sub = block_substep(fast, batch, batch.aux_hidden, blocks, BLOCK_STAGE, targets)
    sub.loss.backward()
    explicit = torch.zeros(2, blocks.anchors.shape[1], BLOCK, D)
    for b in range(2):
        states = slow.project(batch.aux_hidden[b])  # (T, d)
        for n, a in enumerate(blocks.anchors[b].tolist()):
            if a >= 0:
                explicit[b, n] = explicit_block(slow, batch.input_ids[b], states, a)
    fast_h = sub.h_hat.view(2, -1, BLOCK - 1, D)  # depths 1 .. S-1
    live = (blocks.anchors >= 0)[..., None, None]
    assert ((fast_h - explicit[:, :, 1:]).abs() * live).max() < TOL
    ref = explicit_block_loss(slow, batch, blocks, explicit, BLOCK_STAGE.loss, BLOCK_STAGE.step_decay)
    assert abs(float(sub.loss.detach()) - float(ref.detach())) < TOL, (float(sub.loss.detach()), float(ref.detach()))
    ref.backward()
    for (name, p), (_, r) in zip(fast.named_parameters(), slow.named_parameters()):
        assert (p.grad - r.grad).abs().max() < TOL * max(1.0, float(r.grad.abs().max())), name


def test_block_anchors_are_distinct_trained_positions_redrawn_per_batch():
    scored = make_batch().loss_mask & (torch.arange(T) > 0)[None]
    first = masks.sample_blocks(scored, BLOCK, 4, torch.Generator().manual_seed(0))
    again = masks.sample_blocks(scored, BLOCK, 4, torch.Generator().manual_seed(0))
    other = masks.sample_blocks(scored, BLOCK, 4, torch.Generator().manual_seed(1))
    assert torch.equal(first.anchors, again.anchors) and not torch.equal(first.anchors, other.anchors)
    for b in range(2):
        picked = [a for a in first.anchors[b].tolist() if a >= 0]
        assert picked == sorted(set(picked)) and len(picked) == min(4, int(scored[b].sum()))
        assert all(bool(scored[b, a]) for a in picked)
    every = masks.sample_blocks(scored, BLOCK, 100)  # more than there are: every candidate once, -1 padded
    assert sorted(a for a in every.anchors[1].tolist() if a >= 0) == scored[1].nonzero().flatten().tolist()
    seen = first.context_visible(T)  # (B, N*S, T): block n's positions see exactly u < its anchor
    for b in range(2):
        for n, a in enumerate(first.anchors[b].tolist()):
            want = torch.arange(T) < a if a >= 0 else torch.zeros(T, dtype=torch.bool)
            assert all(torch.equal(seen[b, n * BLOCK + k], want) for k in range(BLOCK))


def test_block_stage_weights_decay_with_depth_and_trains_block_drafts_only():
    blocks = masks.Blocks(torch.tensor([[2, -1]]), 4)
    assert blocks.depth_weights(0.5).tolist() == [1.0, 0.5, 0.25]
    assert blocks.rows().tolist() == [[[2, 3, 4], [-1, -1, -1]]]
    with pytest.raises(ValueError, match="block"):
        list(substeps(make_draft("eagle3"), make_batch(aux=True), BLOCK_STAGE))
    with pytest.raises(ValueError, match="block"):
        list(substeps(make_block_draft(), make_batch(aux=True), stage_for("eagle3", "ttt")))
