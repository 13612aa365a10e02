"""Training stages as sequences of sub-steps ("Cross-Attention Speculative Decoding" (Beagle) §4.2;
"Learning Harmonized Representations for Speculative Sampling" (HASS) §3.2 and App. A.1; "EAGLE-3:
Scaling up Inference Acceleration of Large Language Models via Training-Time Test" §3).

``substeps(draft, batch, stage)`` yields one ``SubStep`` per forward the stage needs; what each
query sees is described in ``masks.py``:

* ``plain``  one step, query p sees true states u < p (EAGLE training; HASS step 1).
* ``early``  one step, inverse block attention with windows of k from offset eps (Beagle Eq. 4);
             every query trained. Beagle only: EAGLE's query input is the previous state,
             which the early mask hides.
* ``late``   s steps in windows of s (Beagle Eq. 6 with l = i, beta_i = s - i + 1); step i trains
             only the queries at window position i, which see the true states before their window
             and the draft's own (detached) states written at window positions 1..i-1. Each step
             computes only its queries, so a batch costs about one early step whatever s is; each
             step is back-propagated on its own, and all read one encoding of the true states per
             batch (``models.shared``: back-propagated once, in the last step's backward). (Summing
             the s losses into one backward measured worse: d=4096 CPU peak s8/s1 1.67 vs 1.20.)
* ``align``  n steps (HASS harmonized context alignment); step j trains all queries p >= j-1 on
             the true states u <= p-j and the draft's own detached states of steps 1..j-1 at
             u = p-j+1 .. p-1, weight decay^(j-1). Each step is back-propagated on its own (the
             true states encoded once per batch, as in ``late``).
* ``ttt``    k steps (EAGLE-3 training-time test, default 7, weights 0.8^(j-1)): the same
             visibility as ``align``, but the fed-back states keep their graph and the whole
             unrolled chain is back-propagated once; each step's states are encoded once for
             the whole chain (``layers.Chain``), so memory grows linearly in k.
* ``block``  one step of a block draft ("DFlash: Block Diffusion for Flash Speculative Decoding"
             §4.2, App. A.1): ``anchors`` anchors drawn per sequence among the trained positions
             (new ones every batch), one block of S positions each, all blocks in one forward
             (``masks.Blocks``); block depth k is trained against the target row a + k - 1 with
             weight step_decay^(k-1) (Eq. 4's exp(-(k-1)/gamma): step_decay = exp(-1/gamma)),
             one weighted mean over every trained (block, depth).

The caller back-propagates each sub-step before advancing the generator, except for ``ttt`` (a
chain back-propagated once, whose sub-steps share one ``layers.Chain``; ``train_batch`` does both).
Any draft x stage x loss weights combination is one ``StageConfig``.
The target side of the losses (``HeadTargets``) is prepared once per batch, not per sub-step,
and only the trained rows reach the output head (``losses.head_loss``).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, ContextManager, Iterator

import torch

from specdraft import masks
from specdraft.configs.stages import CHAINED, LossWeights, StageConfig
from specdraft.batch import Batch
from specdraft.losses import TEACHER_P_BYTES, HeadTargets, add_noise, feature_l1, head_loss, weighted_mean
from specdraft.models.layers import Chain
from specdraft.models.shared import SharedEncoding



@dataclass
class SubStep:
    step: int  # 1-based sub-step index
    weight: float  # beta for this sub-step
    query_index: torch.Tensor  # (Q,), or (B, Q) target rows per batch row (block: -1 where none)
    h_hat: torch.Tensor  # (B, Q, d)
    loss: torch.Tensor  # scalar: weighted sum of the enabled parts (before ``weight``)
    parts: dict[str, torch.Tensor]  # ce / topk / vloss, detached
    correct: torch.Tensor  # (B, Q) draft top-1 == target top-1 (on scored positions)
    scored: torch.Tensor  # (B, Q) positions whose prediction counts (loss mask, not padding, p > 0)
    trained: torch.Tensor  # (B, Q) scored positions that carry a loss
    depth: torch.Tensor | None = None  # (Q,) block: each query's depth k in its block (metrics per depth)


@dataclass
class Targets:
    """The target side of one batch, prepared once: head targets for every scored position."""

    scored: torch.Tensor  # (B, T) bool: loss_mask & valid & p > 0
    trainable: torch.Tensor  # (B, T) bool: scored and learnable (target top-1 inside the draft vocabulary)
    row: torch.Tensor  # (B, T) long: row of each scored position in ``head`` (-1 elsewhere)
    head: HeadTargets


def features_of(core, batch: Batch) -> torch.Tensor:
    """The target features the draft reads: the auxiliary layers (EAGLE-3 features) or the last hidden state."""
    if core.config.aux_layers:
        if batch.aux_hidden is None:
            raise ValueError(
                f"the {core.config.arch} draft reads auxiliary target layers {core.config.aux_layers}, but the batch "
                "has no aux_hidden: dump the store with aux_layers (e.g. aux_layers=eagle3)"
            )
        return batch.aux_hidden
    return batch.hidden


@torch.no_grad()
def prepare_targets(core, batch: Batch, weights: LossWeights, chunk: int = 1024) -> Targets:
    """Teacher side of the losses for every scored position of ``batch``, in row chunks.

    Shared frozen head: P = softmax(W h_true) over the vocabulary (h_true = the stored last hidden
    state), ``m_ce = W^T P``; the top-K loss uses the stored top-K (exact: taken from the dump's
    fp32 logits) or, without one, the top-K of P. Own draft vocabulary (EAGLE-3): P renormalised on
    the draft vocabulary, computed from the stored hidden state through the target's lm_head rows;
    top-K taken from it; positions whose target top-1 (stored) is outside the draft vocabulary are
    scored (as misses) but not trained, as SpecForge does.
    """
    heads = core.heads
    bsz, t = batch.input_ids.shape
    pos = torch.arange(t, device=batch.input_ids.device)
    scored = batch.loss_mask & batch.valid & (pos > 0)[None]  # (B, T)
    rows = scored.nonzero(as_tuple=True)
    row = torch.full((bsz, t), -1, dtype=torch.long, device=scored.device)
    row[rows] = torch.arange(rows[0].numel(), device=scored.device)
    w_t = heads.teacher_weight  # (Vd, d_t)
    h_true = batch.hidden[rows].to(w_t.dtype)  # (N, d_t)
    n = h_true.shape[0]
    k = batch.topk_ids.shape[-1] if batch.topk_ids is not None else weights.topk_k
    top1 = torch.zeros(n, dtype=torch.long, device=h_true.device)
    lse = torch.zeros(n, dtype=torch.float32, device=h_true.device)
    want_topk = bool(weights.topk)
    own = core.config.own_vocab
    m_ce = None if own else torch.zeros(n, w_t.shape[1], dtype=torch.float32, device=h_true.device)
    m_topk = torch.zeros_like(m_ce) if (want_topk and not own) else None
    mass = torch.zeros(n, dtype=torch.float32, device=h_true.device) if (want_topk and not own) else None
    stored = batch.topk_ids is not None
    topk_ids = torch.zeros(n, k, dtype=torch.long, device=h_true.device) if (want_topk and (own or not stored)) else None
    topk_logp = torch.zeros(n, k, dtype=torch.float32, device=h_true.device) if topk_ids is not None else None
    keep_p = own and n * w_t.shape[0] * 4 <= TEACHER_P_BYTES  # the teacher's distribution, for every sub-step
    teacher_p = torch.empty(n, w_t.shape[0], dtype=torch.float32, device=h_true.device) if keep_p else None
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        zt = (h_true[lo:hi] @ w_t.T).float()  # (n, Vd)
        lse[lo:hi] = torch.logsumexp(zt, dim=-1)
        top1[lo:hi] = zt.argmax(-1)
        if topk_ids is not None:
            top = zt.topk(min(k, zt.shape[-1]), dim=-1)
            topk_ids[lo:hi, : top.indices.shape[1]] = top.indices
            topk_logp[lo:hi, : top.values.shape[1]] = top.values - lse[lo:hi, None]
        if own:
            if keep_p:
                torch.exp(zt - lse[lo:hi, None], out=teacher_p[lo:hi])  # (n, Vd): losses.teacher_probs's values
            continue
        p = torch.exp(zt - lse[lo:hi, None])  # (n, V)
        m_ce[lo:hi] = (p.to(w_t.dtype) @ w_t).float()
        if want_topk:
            if stored:
                ids = batch.topk_ids[rows[0][lo:hi], rows[1][lo:hi]]  # (n, K)
                pk = batch.topk_logp[rows[0][lo:hi], rows[1][lo:hi]].float().exp()  # (n, K)
            else:
                ids, pk = topk_ids[lo:hi], topk_logp[lo:hi].exp()
            m_topk[lo:hi] = torch.einsum("nk,nkd->nd", pk, w_t[ids].float())
            mass[lo:hi] = pk.sum(-1)
    trainable = scored.clone()
    if own:
        head = HeadTargets(top1=top1, teacher_h=h_true, teacher_w=w_t, teacher_lse=lse,
                           topk_ids=topk_ids, topk_logp=topk_logp, teacher_p=teacher_p)
        if stored:  # the target's own top-1 over its whole vocabulary must be one the draft can emit
            emittable = heads.t2d[batch.topk_ids[rows][:, 0]]  # (N,)
            trainable[rows] = emittable
            top1[~emittable] = -1  # never matched: the draft cannot propose the target's token
    else:
        head = HeadTargets(top1=top1, m_ce=m_ce, m_topk=m_topk, topk_mass=mass)
    return Targets(scored=scored, trainable=trainable, row=row, head=head)


def score(core, batch: Batch, targets: Targets, query_index: torch.Tensor, h_hat: torch.Tensor,
          weights: LossWeights, chunk: int = 1024, live: torch.Tensor | None = None, defer_weight_grad: bool = False,
          query_weight: torch.Tensor | None = None):
    """Losses of predicted states ``h_hat`` (B, Q, d) at ``query_index`` against the target.

    ``query_index``: the target row of every query, (Q,) shared by the batch rows or (B, Q) per row
    (-1: none). ``live`` (Q,): queries that have an input at all (see ``DraftConfig.needs_root_state``).
    ``query_weight`` (Q,): each query's weight in the weighted mean (block depths; default 1).
    ``defer_weight_grad``: a trainable head's weight gradient computed in the backward (``losses.head_loss``)."""
    bsz, t = targets.scored.shape
    index = query_index[None].expand(bsz, -1) if query_index.dim() == 1 else query_index  # (B, Q)
    live = torch.ones(index.shape[1], dtype=torch.bool, device=index.device) if live is None else live
    inside = (index >= 0) & (index < t) & live[None]  # (B, Q)
    safe = index.clamp(0, t - 1)  # (B, Q)
    scored = targets.scored.gather(1, safe) & inside  # (B, Q)
    trained = targets.trainable.gather(1, safe) & inside  # (B, Q)
    where = scored.nonzero(as_tuple=True)
    rows = targets.row.gather(1, safe)[where]  # (M,)
    learn = trained[where].float()  # (M,) 1 on trained rows
    if query_weight is not None:
        learn = learn * query_weight[where[1]].float()  # (M,)
    count = learn.sum().clamp(min=1.0) if query_weight is None else learn.sum().clamp(min=1e-12)
    h = h_hat[where]  # (M, d)
    head = core.heads
    loss, ce, tk, correct_rows = head_loss(
        head.head_input(h), head.weight, targets.head.rows(rows),
        weights.ce * learn / count, weights.topk * learn / count, chunk, defer_weight_grad,
    )
    parts: dict[str, torch.Tensor] = {}
    if weights.ce:
        parts["ce"] = (ce * learn).sum() / count
    if weights.topk:
        parts["topk"] = (tk * learn).sum() / count
    if weights.vloss:
        h_true = batch.hidden[where[0], safe[where]]  # (M, d)
        parts["vloss"] = weighted_mean(feature_l1(h, h_true), learn)
        loss = loss + weights.vloss * parts["vloss"]
    correct = torch.zeros_like(scored)
    correct[where] = correct_rows
    return loss, {k: v.detach() for k, v in parts.items()}, correct, scored, trained


def stage_steps(stage: StageConfig, length: int, offset: int, device) -> Iterator[masks.Step]:
    """The sub-steps of ``stage`` over sequences of ``length`` with window offset ``offset``."""
    if stage.kind == "plain":
        yield masks.plain(length, device)
    elif stage.kind == "early":
        yield masks.early(length, stage.window, offset, device)
    elif stage.kind == "late":
        for i in range(1, stage.steps + 1):
            yield masks.late_step(length, stage.steps, offset, i, device)
    else:  # align, ttt
        for j in range(1, stage.steps + 1):
            yield masks.align_step(length, j, stage.step_decay, device)


def stage_note(index: int, stages: list[StageConfig]) -> str:
    """The line printed when stage ``index`` starts: what it trains and what its loss is. A chained stage's loss
    is the weighted sum of its sub-steps' losses (Beagle's late stage: beta_i = s - i + 1, 10 times a one-step
    loss for s = 4), so without this line its first step looks like the training diverged."""
    stage = stages[index]
    weights = [step.weight for step in stage_steps(stage, stage.steps + stage.window, 0, "cpu")]
    line = f"stage {index} ({stage.kind}, {stage.epochs} epoch{'s' * (stage.epochs != 1)})"
    if len(weights) == 1:
        return line + ": loss = the loss of its one step"
    total = sum(weights)
    return (line + f": loss = sum of beta_i * loss_i over its {len(weights)} steps, beta = "
            f"{', '.join(f'{w:.3g}' for w in weights)} (sum {total:.3g}): about {total:.3g}x a one-step loss, not "
            f"comparable with a one-step stage's; loss_step1..{len(weights)} in metrics.jsonl are the steps' own")


def check_stage(core, stage: StageConfig) -> None:
    """Refuse combinations a draft cannot train, with the reason."""
    arch = core.config.arch
    if (stage.kind == "block") != core.config.drafts_blocks:
        raise ValueError(
            f"stage {stage.kind!r} cannot train a {arch!r} draft: a block draft (dflash) trains with the 'block' "
            "stage only (whole blocks from anchors), and the 'block' stage trains block drafts only"
        )
    if stage.kind == "early" and arch != "beagle":
        raise ValueError(
            f"stage 'early' needs a draft whose queries come from tokens only (beagle); {arch!r} feeds "
            "the previous state into each query, which the inverse block mask hides — use 'late', 'align' or 'ttt'"
        )
    if stage.loss.vloss and (core.config.aux_layers or core.config.own_vocab):
        raise ValueError(
            "vloss regresses the draft's state onto the target's last hidden state; a draft reading auxiliary "
            "layers or with its own vocabulary predicts in its own feature space — set loss.vloss=0"
        )


def substeps(
    draft,
    batch: Batch,
    stage: StageConfig,
    *,
    offset: int = 0,
    generator: torch.Generator | None = None,
    targets: Targets | None = None,
    chunk: int = 1024,
    share_true: bool = True,
) -> Iterator[SubStep]:
    """Yield the sub-steps of one training batch for ``stage`` (see module docstring).

    ``draft`` may be a wrapper (DDP/FSDP) exposing the draft as ``.module``: forwards go
    through the wrapper (so gradients synchronise), attributes come from the draft.
    Sub-steps back-propagated on their own (late, align) share one encoding of the true states
    (``models.shared``); ``share_true=False`` encodes them anew in every sub-step (the reference).
    """
    core = unwrap(draft)
    check_stage(core, stage)
    assert 0 <= offset < stage.period, f"offset {offset} outside [0, {stage.period})"
    dtype = next(p for p in core.parameters()).dtype
    features = add_noise(features_of(core, batch).to(dtype), stage.noise_std, generator)  # (B, T, F)
    if targets is None:
        targets = prepare_targets(core, batch, stage.loss, chunk)
    if stage.kind == "block":
        blocks = masks.sample_blocks(targets.scored, core.config.block_size, stage.anchors, generator)
        yield block_substep(draft, batch, features, blocks, stage, targets, chunk)
        return
    ids, pos = batch.input_ids, batch.positions
    t = ids.shape[1]
    # The draft's states written at each sub-step. A chain trained by one backward (ttt) hands every
    # sub-step the whole ``Chain``, whose encodings the sub-steps share; the other stages back-propagate
    # each sub-step on its own (its graph is gone after), so they hand each sub-step a fresh chain of
    # its queries' states, encoded anew, and the true states' encoding of the batch (``shared``).
    chain = Chain(t, recompute=stage.recompute)
    defer = defers_head_grad(core, stage)
    shared = SharedEncoding(stage.num_substeps) if share_true and stage.kind in ("late", "align") else None
    for st in stage_steps(stage, t, offset, ids.device):
        q = st.query_index
        assert len(chain.states) == st.extras, "a sub-step reads states no earlier sub-step wrote"
        extras = chain if stage.kind == "ttt" else chain.read(q)
        extras.shared = shared
        h_hat = draft(ids, pos, features, q, st.cutoff, extras)  # (B, Q, d)
        live = st.cutoff >= 1 if core.config.needs_root_state else None
        loss, parts, correct, scored, trained = score(core, batch, targets, q, h_hat, stage.loss, chunk, live,
                                                      defer_weight_grad=defer)
        yield SubStep(st.index, st.weight, q, h_hat, loss, parts, correct, scored, trained)
        if stage.kind in CHAINED:
            fed = h_hat if stage.kind == "ttt" else h_hat.detach()
            chain.add(fed, q)  # (B, Q, d) at q


HEAD_GRAD_BYTES = 1 << 30  # the most a ttt chain's forwards may keep of (V, d) fp32 head weight gradients


def defers_head_grad(core, stage: StageConfig) -> bool:
    """Whether a ttt chain's sub-steps leave a trainable head's weight gradient to the backward (``losses.head_loss``):
    kept from each forward, k of them are k (V, d) fp32 buffers until the one backward; deferred, each chunk's
    logits are computed twice. Deferred when the k buffers would pass ``HEAD_GRAD_BYTES`` (an 8B draft's head,
    32k x 4096: 7 x 0.5 GB); kept below it (SmolLM2's, 32k x 576: 7 x 74 MB, for a quarter of the head's FLOPs)."""
    weight = core.heads.weight
    return stage.kind == "ttt" and weight.requires_grad and stage.steps * weight.numel() * 4 > HEAD_GRAD_BYTES


def block_substep(draft, batch: Batch, features: torch.Tensor, blocks: masks.Blocks, stage: StageConfig,
                  targets: Targets, chunk: int = 1024) -> SubStep:
    """The one sub-step of the ``block`` stage: every block of ``blocks`` drafted in one forward, depths
    1 .. S-1 scored against target rows a + k - 1 with weights ``step_decay^(k-1)``."""
    core = unwrap(draft)
    h = draft(batch.input_ids, batch.positions, features, blocks.anchors)  # (B, N, S, d)
    bsz, n, size, d = h.shape
    rows = blocks.rows().flatten(1)  # (B, N*(S-1))
    depth = torch.arange(1, size, device=rows.device).repeat(n)  # (N*(S-1),)
    weight = blocks.depth_weights(stage.step_decay).repeat(n)  # (N*(S-1),)
    h_hat = h[:, :, 1:].reshape(bsz, n * (size - 1), d)  # (B, Q, d): the anchor's own output is not a draft
    loss, parts, correct, scored, trained = score(core, batch, targets, rows, h_hat, stage.loss, chunk,
                                                  query_weight=weight)
    return SubStep(1, 1.0, rows, h_hat, loss, parts, correct, scored, trained, depth=depth)


def unwrap(model):
    """The draft inside a DDP/FSDP-style wrapper (or the model itself)."""
    return getattr(model, "module", model)


def draw_offset(stage: StageConfig, generator: torch.Generator | None) -> int:
    """Random window offset eps in [0, period) for one batch (a new eps per batch)."""
    return int(torch.randint(stage.period, (1,), generator=generator).item())


GradSync = Callable[[bool], ContextManager]


def no_grad_sync_needed(enabled: bool) -> ContextManager:  # noqa: ARG001 - the single-process default
    return nullcontext()


def train_batch(
    draft,
    batch: Batch,
    stage: StageConfig,
    *,
    generator=None,
    scale: float = 1.0,
    grad_sync: GradSync = no_grad_sync_needed,
    sync_last: bool = True,
    chunk: int = 1024,
    offset: int | None = None,
) -> dict[str, float]:
    """Forward + backward for one batch; returns scalar metrics. No optimizer step.

    Detached stages (late, align) back-propagate each sub-step on its own (constant memory in the
    number of steps); ``ttt`` sums the weighted step losses and back-propagates once.
    ``grad_sync(enabled)`` is entered around every forward+backward: a distributed wrapper synchronises gradients only
    where ``enabled`` (the last backward of the batch, and only if ``sync_last``).
    """
    offset = draw_offset(stage, generator) if offset is None else offset
    core = unwrap(draft)
    targets = prepare_targets(core, batch, stage.loss, chunk)
    metrics: dict[str, float] = {}
    total, pending = 0.0, None
    steps = substeps(draft, batch, stage, offset=offset, generator=generator, targets=targets, chunk=chunk)
    n = stage.num_substeps
    for i in range(n):
        last = i == n - 1
        with grad_sync(last and sync_last):
            sub = next(steps)
            weighted = scale * sub.weight * sub.loss
            if stage.kind == "ttt":
                pending = weighted if pending is None else pending + weighted
                if last:
                    pending.backward()
            else:
                weighted.backward()
        total += sub.weight * float(sub.loss.detach())
        metrics[f"loss_step{sub.step}"] = float(sub.loss.detach())
        for name, value in sub.parts.items():
            metrics[f"{name}_step{sub.step}"] = float(value)
        if sub.depth is None:
            count = sub.scored.sum().clamp(min=1)
            metrics[f"acc_step{sub.step}"] = float((sub.correct & sub.scored).sum() / count)
            continue
        for k in range(1, int(sub.depth.max()) + 1):  # block: top-1 accuracy at every depth of the block
            at = sub.scored & (sub.depth == k)[None]  # (B, Q)
            metrics[f"acc_step{k}"] = float((sub.correct & at).sum() / at.sum().clamp(min=1))
    metrics["loss"] = total
    return metrics
