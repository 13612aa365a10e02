"""Per-position training losses, fused with the output head (soft cross-entropy and feature regression:
"EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty" §4.2; top-K distillation:
"Learning Harmonized Representations for Speculative Sampling" (HASS) §3.1).

* ``ce``   soft cross-entropy -sum_x P(x) log Q(x) over the output vocabulary (EAGLE/HASS; over a
           draft vocabulary, P is the target distribution renormalised on it, as EAGLE-3 does).
* ``topk`` HASS harmonized objective distillation (HASS §3.1, Eq. 1):
           -sum_{x in topK(P)} P(x) log Q(x).
* ``vloss`` SmoothL1(h_hat, H), the EAGLE feature regression (Beagle App. A.3 weights it 10).

At real scale the logits are the memory problem: 32k tokens x a 128k vocabulary is 16.8 GB per
fp32 tensor. ``head_loss`` never materialises them: it walks the rows in chunks, computes each
chunk's logits, log-sum-exp, the loss values and — since the loss is linear in the per-row
coefficients, which are known up front — the gradients with respect to h and the head weight,
then drops the chunk (SpecForge §4.2.2 reuses the logits buffer for the same reason). The
backward pass only scales the stored gradients (a chain trained by one backward, ``ttt``, asks for
a trainable head's weight gradient there instead, from the chunks' logits computed again, so that
its k forwards do not each keep a vocabulary x d buffer). Values and gradients equal the
materialised formulas (``soft_ce``/``topk_ce``, kept as the reference).

The target side is prepared once per batch (``HeadTargets``). With the target's own frozen head
(Beagle, EAGLE) the loss needs only d-wide vectors per row: sum_x P(x) z_x = (W^T P)·h, so
``m_ce = W^T P`` and ``m_topk = sum_k P_k W_{x_k}`` replace the (rows x vocab) target
distribution. With a trainable draft head (EAGLE-3) the teacher's distribution over the draft
vocabulary is prepared once per batch too (with its normaliser and top-K), kept for every sub-step
while it fits ``TEACHER_P_BYTES``, else recomputed per chunk from the stored hidden state.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F


def soft_ce(draft_logp: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Reference: (N, V) draft log-probs, (N, V) target logits -> (N,) cross-entropy."""
    target_p = torch.softmax(target_logits.float(), dim=-1)  # (N, V)
    return -(target_p * draft_logp).sum(-1)


def topk_ce(draft_logp: torch.Tensor, topk_ids: torch.Tensor, topk_logp: torch.Tensor) -> torch.Tensor:
    """Reference top-K distillation: (N, V) draft log-probs, (N, K) target ids and log-probs -> (N,)."""
    picked = draft_logp.gather(-1, topk_ids)  # (N, K)
    return -(topk_logp.float().exp() * picked).sum(-1)


def feature_l1(h_hat: torch.Tensor, h_true: torch.Tensor) -> torch.Tensor:
    """SmoothL1 between predicted and true states, averaged over d: (N, d) -> (N,)."""
    return F.smooth_l1_loss(h_hat.float(), h_true.float(), reduction="none").mean(-1)


def weighted_mean(values: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """sum(w * v) / max(sum(w), 1)."""
    weight = weight.to(values.dtype)
    return (values * weight).sum() / weight.sum().clamp(min=1.0)


def add_noise(states: torch.Tensor, std: float, generator: torch.Generator | None) -> torch.Tensor:
    """Gaussian input noise N(0, std^2) on true states (EAGLE; Beagle App. A.3 uses 0.2)."""
    if std <= 0:
        return states
    device = generator.device if generator is not None else states.device
    noise = torch.randn(states.shape, generator=generator, device=device, dtype=torch.float32)
    return states + (std * noise).to(device=states.device, dtype=states.dtype)


@dataclass
class HeadTargets:
    """The target side of ``head_loss`` for N rows, prepared once per batch (no gradient).

    ``top1`` is always set (output-vocabulary ids). Shared frozen head: ``m_ce`` (N, d) and, for the
    top-K loss, ``m_topk`` (N, d) + ``topk_mass`` (N,). Own head: ``teacher_h`` (N, d_t),
    ``teacher_w`` (Vd, d_t) and ``teacher_lse`` (N,), plus ``topk_ids``/``topk_logp`` (N, K), and
    ``teacher_p`` (N, Vd) fp32 — the teacher's distribution, softmax(teacher_h teacher_w^T), kept from
    ``prepare`` when it fits a budget (``TEACHER_P_BYTES``) so that no sub-step computes it again; None:
    each chunk recomputes it from ``teacher_h`` (the same values).
    """

    top1: torch.Tensor
    m_ce: torch.Tensor | None = None
    m_topk: torch.Tensor | None = None
    topk_mass: torch.Tensor | None = None
    teacher_h: torch.Tensor | None = None
    teacher_w: torch.Tensor | None = None
    teacher_lse: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    topk_logp: torch.Tensor | None = None
    teacher_p: torch.Tensor | None = None

    @property
    def shared(self) -> bool:
        return self.teacher_w is None

    def rows(self, index: torch.Tensor | slice) -> "HeadTargets":
        """The targets of rows ``index`` (M,) or of a slice of rows: views of a slice, or of a run of consecutive
        rows when there is a ``teacher_p`` (its (M, Vd) rows are not copied then), else copies."""
        if isinstance(index, torch.Tensor) and self.teacher_p is not None:
            index = _as_slice(index)
        picked = {}
        for f in fields(self):
            value = getattr(self, f.name)
            picked[f.name] = value if value is None or f.name == "teacher_w" else value[index]
        return HeadTargets(**picked)


def _as_slice(index: torch.Tensor) -> torch.Tensor | slice:
    """``index`` (M,) as a slice when it is a run of consecutive ascending rows, else as it is."""
    n = index.numel()
    if n and int(index[-1]) - int(index[0]) + 1 == n and bool((index[1:] > index[:-1]).all()):
        return slice(int(index[0]), int(index[0]) + n)
    return index


TEACHER_P_BYTES = 1 << 30  # the most a batch's teacher distributions (N x Vd fp32) may take to be kept, not recomputed


def teacher_probs(teacher_h: torch.Tensor, teacher_w: torch.Tensor, teacher_lse: torch.Tensor) -> torch.Tensor:
    """The teacher's distribution over the output vocabulary (n, Vd) fp32 from its rows' hidden states (n, d_t)."""
    zt = (teacher_h.to(teacher_w.dtype) @ teacher_w.T).float()  # (n, Vd) teacher logits
    return torch.exp(zt - teacher_lse[:, None])


def _rowdot(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """sum_v x[n, v] * y[n, v] for fp32 rows (n, V) -> (n,), in fp32 (never autocast) and without an (n, V) product."""
    with torch.autocast(x.device.type, enabled=False):
        return torch.bmm(x[:, None, :], y[:, :, None])[:, 0, 0]


def _chunk_terms(hc: torch.Tensor, weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, t: HeadTargets,
                 use_topk: bool):
    """One chunk of ``head_loss``: rows hc (n, d) in the head's dtype, coefficients a, b (n, 1).

    Returns (ce (n,), topk (n,), draft argmax (n,), g (n, V), lin): ``g`` is d loss / d logits (with
    the shared frozen head, beyond the terms linear in h, which are ``lin`` (n, d); else ``lin`` is None).
    The (n, V) work is done in place in the one fp32 logits buffer, which becomes ``g``: each extra (n, V)
    temporary is a fresh allocation (page faults) and a pass over memory, and these passes, not the
    products, were most of the head's time on a CPU (SmolLM2's 32k x 576 head).
    """
    z = F.linear(hc, weight).float()  # (n, V) logits (not hc @ weight.T: autocast casts a view anew at every call): becomes the draft's distribution, then g, in place
    zmax, top = z.max(dim=-1)  # (n,)
    tk = torch.zeros_like(zmax)  # (n,)
    if not t.shared:  # the terms that read the logits themselves, before they are overwritten
        target_p = t.teacher_p if t.teacher_p is not None else teacher_probs(t.teacher_h, t.teacher_w, t.teacher_lse)
        p_dot_z = _rowdot(target_p, z)  # (n,): sum_x P(x) z_x
        z_topk = z.gather(-1, t.topk_ids) if use_topk else None  # (n, K)
    p = z.sub_(zmax[:, None]).exp_()  # (n, V) unnormalised: one exp pass
    total = p.sum(-1)  # (n,)
    lse = zmax + total.log()  # (n,)
    if t.shared:
        hf = hc.float()
        ce = lse - (t.m_ce * hf).sum(-1)
        lin = a * t.m_ce  # (n, d): d/dh of -(a * m_ce . h)
        coef = a
        if use_topk:
            tk = t.topk_mass * lse - (t.m_topk * hf).sum(-1)
            lin = lin + b * t.m_topk
            coef = a + b * t.topk_mass[:, None]
        return ce, tk, top, p.mul_(coef / total[:, None]), lin  # coef * softmax
    ce = lse - p_dot_z
    coef = a
    if use_topk:
        pk = t.topk_logp.float().exp()  # (n, K)
        tk = pk.sum(-1) * lse - (pk * z_topk).sum(-1)
        coef = a + b * pk.sum(-1, keepdim=True)
    g = p.mul_(coef / total[:, None]).addcmul_(target_p, a, value=-1.0)  # a (q - P) + b (sum_k P_k) q
    if use_topk:
        g.scatter_add_(-1, t.topk_ids, -(b * pk))  # - b P_k at the top-K ids
    return ce, tk, top, g, None


def _add_product(total: torch.Tensor | None, g: torch.Tensor, hc: torch.Tensor) -> torch.Tensor:
    """``total`` + g^T hc in fp32 (V, d), or the product itself (fp32) when ``total`` is None: the values of a zero
    buffer plus each chunk's product, without filling and adding a (V, d) buffer of zeros."""
    part = g.T @ hc.float()  # (V, d)
    return part.float() if total is None else total.add_(part)


def _low(g: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``g`` (n, V) in the dtype its products with the head run in (the autocast dtype when autocast is on, else
    the head's), cast once for both products (the input and weight gradients) instead of once in each."""
    g = g.to(weight.dtype)
    kind = g.device.type
    if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
        return g.to(torch.get_autocast_dtype(kind))
    return g


class _HeadLoss(torch.autograd.Function):
    """sum_n ce_coef[n] * ce_n + topk_coef[n] * topk_n, in row chunks, gradients computed forward.

    With ``defer_weight_grad`` a trainable head's weight gradient is not computed forward but in the
    backward, from the chunks' logits computed again: a (V, d) fp32 buffer is then not kept from the
    forward to the backward. That is for a caller that keeps several forwards' graphs for one backward
    (training-time test: k of them, 7 x 0.5 GB at a 32k x 4096 draft head), at the price of the
    chunks' logits twice."""

    @staticmethod
    def forward(ctx, h, weight, ce_coef, topk_coef, targets: HeadTargets, chunk: int, defer_weight_grad: bool):
        n_rows = h.shape[0]
        want_w = weight.requires_grad
        assert not (want_w and targets.shared), "a trainable head needs the teacher's rows (HeadTargets.teacher_w)"
        use_topk = bool((topk_coef != 0).any()) and (targets.m_topk is not None or targets.topk_ids is not None)
        now_w = want_w and not defer_weight_grad
        grad_h = torch.zeros(h.shape, dtype=torch.float32, device=h.device)  # (N, d)
        grad_w = None  # (V, d) fp32: the first chunk's product, then the sum over chunks
        ce = torch.zeros(n_rows, dtype=torch.float32, device=h.device)  # (N,)
        tk = torch.zeros(n_rows, dtype=torch.float32, device=h.device)  # (N,)
        correct = torch.zeros(n_rows, dtype=torch.bool, device=h.device)  # (N,)
        for lo, hc, a, b, t in _chunks(h, weight, ce_coef, topk_coef, targets, chunk):
            hi = lo + hc.shape[0]
            ce[lo:hi], tk[lo:hi], top, g, lin = _chunk_terms(hc, weight, a, b, t, use_topk)
            correct[lo:hi] = top == t.top1
            g = _low(g, weight)  # (n, V)
            grad_h[lo:hi] = (g @ weight).float() - (0.0 if lin is None else lin)
            if now_w:
                grad_w = _add_product(grad_w, g, hc)  # (V, d)
        loss = (ce_coef.float() * ce).sum() + ((topk_coef.float() * tk).sum() if use_topk else 0.0)
        deferred = want_w and defer_weight_grad
        ctx.save_for_backward(grad_h, grad_w if now_w else torch.empty(0), *((h, weight, ce_coef, topk_coef)
                                                                           if deferred else ()))
        ctx.want_w, ctx.deferred, ctx.h_dtype = want_w, deferred, h.dtype
        ctx.targets, ctx.chunk, ctx.use_topk = (targets, chunk, use_topk) if deferred else (None, chunk, use_topk)
        ctx.mark_non_differentiable(ce, tk, correct)
        return loss, ce, tk, correct

    @staticmethod
    def backward(ctx, grad_loss, *_):
        grad_h, grad_w, *inputs = ctx.saved_tensors
        gh = (grad_loss * grad_h).to(ctx.h_dtype)
        if ctx.deferred:  # the weight gradient from the chunks' logits again (see the class docstring)
            h, weight, ce_coef, topk_coef = inputs
            grad_w = None  # (V, d)
            for _, hc, a, b, t in _chunks(h, weight, ce_coef, topk_coef, ctx.targets, ctx.chunk):
                g = _low(_chunk_terms(hc, weight, a, b, t, ctx.use_topk)[3], weight)  # (n, V)
                grad_w = _add_product(grad_w, g, hc)
        gw = (grad_loss * grad_w) if ctx.want_w else None
        return gh, gw, None, None, None, None, None


def _chunks(h, weight, ce_coef, topk_coef, targets: HeadTargets, chunk: int):
    """(first row, rows (n, d) in the head's dtype, ce and top-K coefficients (n, 1), their targets) per chunk."""
    for lo in range(0, h.shape[0], chunk):
        hi = min(h.shape[0], lo + chunk)
        yield (lo, h[lo:hi].to(weight.dtype), ce_coef[lo:hi].float()[:, None], topk_coef[lo:hi].float()[:, None],
               targets.rows(slice(lo, hi)))


def head_loss(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: HeadTargets,
    ce_coef: torch.Tensor,
    topk_coef: torch.Tensor,
    chunk: int = 1024,
    defer_weight_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused output head + losses for N rows.

    h (N, d) the head's input (after its norm), ``weight`` (V, d) the output projection (frozen or
    trainable), per-row coefficients (N,) of the ce and top-K losses. Returns the scalar
    sum(ce_coef * ce + topk_coef * topk) (differentiable in h and weight) and, detached, the
    per-row ce (N,), topk (N,) and whether the head's argmax equals the teacher's top-1 (N,).
    ``defer_weight_grad``: a trainable head's weight gradient computed in the backward (see ``_HeadLoss``).
    """
    assert h.dim() == 2 and weight.dim() == 2 and h.shape[1] == weight.shape[1], (
        f"head input {tuple(h.shape)} and weight {tuple(weight.shape)} do not match"
    )
    assert ce_coef.shape == topk_coef.shape == (h.shape[0],), "one ce and one top-K coefficient per row"
    assert chunk >= 1, "chunk must be >= 1"
    if h.shape[0] == 0:  # still a graph through h and a trainable weight: every rank reduces the same gradients
        zero = h.new_zeros((), dtype=torch.float32) + 0.0 * h.sum() + (0.0 * weight.sum() if weight.requires_grad else 0.0)
        empty = torch.zeros(0, device=h.device)
        return zero, empty, empty, torch.zeros(0, dtype=torch.bool, device=h.device)
    return _HeadLoss.apply(h, weight, ce_coef, topk_coef, targets, chunk, defer_weight_grad)
