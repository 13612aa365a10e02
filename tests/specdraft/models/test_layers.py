"""Attention with per-query diagonals against an explicit softmax loop; what a ttt chain keeps for backward."""

from __future__ import annotations

import pytest
import torch

from specdraft.models.layers import KV, RMSNorm, SwiGLU, attention, shared_logsumexp, take
from specdraft.objectives import substeps
from specdraft.configs.stages import LossWeights, StageConfig

TOL = 1e-5


def explicit_attention(q, kv, visible, extra):
    """One query at a time: its visible shared keys then its own diagonal keys, one softmax."""
    bsz, heads, nq, dh = q.shape
    groups = heads // kv.k.shape[1]
    out = torch.zeros_like(q)
    for b in range(bsz):
        for h in range(heads):
            g = h // groups
            for i in range(nq):
                keys = [kv.k[b, g, u] for u in range(kv.length) if visible[b, i, u]]
                vals = [kv.v[b, g, u] for u in range(kv.length) if visible[b, i, u]]
                keys += [d.k[b, g, i] for d in extra]
                vals += [d.v[b, g, i] for d in extra]
                if not keys:
                    continue
                s = torch.stack(keys) @ q[b, h, i] / dh**0.5
                out[b, h, i] = torch.softmax(s, 0) @ torch.stack(vals)
    return out


def case(seed: int = 0, e: int = 3):
    g = torch.Generator().manual_seed(seed)
    bsz, heads, hkv, nq, length, dh = 2, 4, 2, 7, 9, 8
    q = torch.randn(bsz, heads, nq, dh, generator=g, requires_grad=True)
    kv = KV(torch.randn(bsz, hkv, length, dh, generator=g, requires_grad=True),
            torch.randn(bsz, hkv, length, dh, generator=g, requires_grad=True))
    visible = torch.rand(bsz, nq, length, generator=g) > 0.4
    visible[0, 2] = False  # a query that sees no shared key: only its diagonals
    extra = [KV(torch.randn(bsz, hkv, nq, dh, generator=g, requires_grad=True),
                torch.randn(bsz, hkv, nq, dh, generator=g, requires_grad=True)) for _ in range(e)]
    return q, kv, visible, extra


@pytest.mark.parametrize("e", [0, 1, 3])
def test_attention_with_diagonals_matches_explicit_softmax(e):
    q, kv, visible, extra = case(e=e)
    leaves = [q, kv.k, kv.v, *[t for d in extra for t in (d.k, d.v)]]
    fast = attention(q, kv, visible, extra)
    w = torch.randn_like(fast)
    fast_grads = torch.autograd.grad((fast * w).sum(), leaves)
    slow = explicit_attention(q, kv, visible, extra)
    slow_grads = torch.autograd.grad((slow * w).sum(), leaves)
    assert (fast - slow).abs().max() < TOL
    for a, b in zip(fast_grads, slow_grads):
        assert torch.isfinite(a).all() and (a - b).abs().max() < TOL


def test_shared_logsumexp_in_chunks_equals_one_pass_and_is_minus_inf_without_keys():
    q, kv, visible, _ = case()
    full = shared_logsumexp(q, kv, visible)
    chunked = shared_logsumexp(q, kv, visible, budget=1)  # one query per chunk
    groups = q.shape[1] // kv.k.shape[1]
    k = kv.k.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5  # (B, H, Q, K)
    ref = torch.logsumexp(scores.masked_fill(~visible[:, None], float("-inf")), dim=-1)
    assert torch.equal(torch.isneginf(full), torch.isneginf(chunked))
    assert (full - chunked)[torch.isfinite(full)].abs().max() < TOL
    assert torch.isneginf(full[0, :, 2]).all() and torch.isneginf(ref[0, :, 2]).all()
    finite = torch.isfinite(ref)
    assert (full[finite] - ref[finite]).abs().max() < TOL


def test_take_is_a_view_for_a_run_and_a_copy_otherwise():
    x = torch.arange(20.0).view(2, 10)
    run = take(x, 1, torch.arange(3, 7))
    assert run.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert torch.equal(run, x[:, 3:7])
    assert torch.equal(take(x, 1, torch.tensor([1, 4, 5])), x[:, [1, 4, 5]])


def saved_bytes(draft, batch, stage) -> int:
    """Bytes of the distinct storages the autograd graph of one ttt chain keeps for its backward."""
    storages: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for _ in substeps(draft, batch, stage):
            pass
    return sum(storages.values())


@pytest.mark.parametrize("draft_kind", ["eagle3", "beagle"])
def test_ttt_keeps_a_constant_amount_per_step(draft_kind):
    """Issue 9.4: a ttt chain's memory grows linearly in k. Each step keeps its own activations and
    the encoding of its fed-back states once; no step re-encodes or copies the earlier steps'."""
    from tests.specdraft.test_objectives import make_batch, make_draft  # the reference tests' tiny draft

    draft = make_draft(draft_kind)
    batch = make_batch(with_topk=True, aux=draft_kind == "eagle3")
    stage = lambda k: StageConfig(kind="ttt", steps=k, noise_std=0.0, loss=LossWeights(ce=1.0))  # noqa: E731
    kept = [saved_bytes(draft, batch, stage(k)) for k in range(1, 7)]
    steps = [b - a for a, b in zip(kept, kept[1:])]  # what steps 2..6 add
    assert all(s > 0 for s in steps), kept
    # the only per-step growth left: E (B, H, Q) scores and softmax weights per step, a few hundred
    # bytes here against tens of kilobytes of activations; re-encoding would add a full step per step
    assert max(steps[1:]) <= 1.05 * steps[0], f"bytes kept for backward by k = 1..6: {kept}"


@pytest.mark.parametrize("draft_kind,kind", [("eagle3", "ttt"), ("beagle", "ttt"), ("eagle", "ttt")])
def test_recompute_gives_the_same_gradients_and_keeps_less(draft_kind, kind):
    """``recompute`` (activation checkpointing of each sub-step's decoder layer) changes what a chain
    keeps for its backward, not its losses or gradients."""
    from specdraft.objectives import train_batch
    from tests.specdraft.test_objectives import make_batch, make_draft

    batch = make_batch(with_topk=True, aux=draft_kind == "eagle3")
    grads, kept = {}, {}
    for recompute in (False, True):
        stage = StageConfig(kind=kind, steps=4, step_decay=0.8, noise_std=0.0, recompute=recompute,
                            loss=LossWeights(ce=1.0, topk=0.5))
        draft = make_draft(draft_kind)
        metrics = train_batch(draft, batch, stage)
        grads[recompute] = (metrics["loss"], {n: p.grad.clone() for n, p in draft.named_parameters()})
        kept[recompute] = saved_bytes(make_draft(draft_kind), batch, stage)
    assert grads[True][0] == pytest.approx(grads[False][0], abs=1e-6)
    for name, g in grads[False][1].items():
        assert (grads[True][1][name] - g).abs().max() <= 1e-6 * max(1.0, float(g.abs().max())), name
    assert kept[True] < 0.7 * kept[False], kept


def plain_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm as written, differentiated by autograd."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("x_dtype, w_dtype, tol", [(torch.float32, torch.float32, 1e-6),
                                                   (torch.bfloat16, torch.float32, 1e-2),
                                                   (torch.bfloat16, torch.bfloat16, 1e-2)])
def test_rms_norm_has_the_plain_formulas_values_and_gradients(x_dtype, w_dtype, tol):
    g = torch.Generator().manual_seed(3)
    norm = RMSNorm(48, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(48, generator=g) + 0.5)
    norm = norm.to(w_dtype)
    x = (torch.randn(2, 5, 48, generator=g) * 3).to(x_dtype).requires_grad_()
    up = torch.randn(2, 5, 48, generator=g)
    y = norm(x)
    (y.float() * up).sum().backward()
    got = (y.detach(), x.grad.clone(), norm.weight.grad.clone())
    x.grad, norm.weight.grad = None, None
    ref = plain_rms_norm(x, norm.weight, 1e-5)
    (ref.float() * up).sum().backward()
    assert y.dtype == ref.dtype
    for a, b in zip(got, (ref.detach(), x.grad, norm.weight.grad)):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


def test_rms_norm_keeps_its_input_and_the_reciprocal_rms_only():
    norm, x = RMSNorm(64, 1e-6), torch.randn(3, 10, 64, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        norm(x)
    sizes = sorted(tuple(t.shape) for t in saved)
    assert sizes == [(3, 10, 1), (3, 10, 64), (64,)], sizes  # rstd, x itself, the weight
    assert any(t.data_ptr() == x.data_ptr() for t in saved)


@pytest.mark.parametrize("autocast", [False, True])
def test_swiglu_has_the_plain_formulas_values_and_gradients_and_keeps_less(autocast):
    g = torch.Generator().manual_seed(4)
    mlp = SwiGLU(32, 80)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    x = torch.randn(2, 6, 32, generator=g, requires_grad=True)
    up = torch.randn(2, 6, 32, generator=g)

    def run(forward):
        saved = []
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                y = forward(x * 1.0)  # an activation, not a leaf: autocast caches casts of leaves only
        (y.float() * up).sum().backward()
        grads = [x.grad.clone()] + [p.grad.clone() for p in mlp.parameters()]
        x.grad = None
        mlp.zero_grad(set_to_none=True)
        activations = {t.untyped_storage().data_ptr() for t in saved  # all but the weights (or their casts)
                       if tuple(t.shape) not in ((32, 80), (80, 32))}
        down = mlp.down_proj.weight.detach().to(torch.bfloat16)  # (32, 80)
        weight_casts = [t for t in saved if t.dtype == torch.bfloat16
                        and any(v.shape == down.shape and torch.equal(v, down) for v in (t, t.T))]
        return y.detach(), grads, len(activations), len(weight_casts)

    plain = run(lambda v: mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(v)) * mlp.up_proj(v)))
    lean = run(mlp)
    tol = 1e-2 if autocast else 1e-6
    torch.testing.assert_close(lean[0], plain[0], rtol=tol, atol=tol)
    for a, b in zip(lean[1], plain[1]):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    # kept for the backward: gate and up outputs (plus, under autocast, one cast of x shared by gate
    # and up) and the fp32 down weight; the plain formula also keeps silu(gate), down's input (and a
    # second cast of x, and a bf16 copy of the down weight)
    assert lean[2] == plain[2] - (3 if autocast else 2), (lean[2], plain[2])
    assert (lean[3], plain[3]) == (0, 1 if autocast else 0), (lean[3], plain[3])
