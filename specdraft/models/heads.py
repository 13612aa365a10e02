"""The draft's vocabulary side: the target's frozen embedding, the output head, and the teacher rows.

Every draft reads token embeddings from the target's frozen ``embed_tokens`` ("Cross-Attention
Speculative Decoding" (Beagle) §4.1; EAGLE likewise). Its output head is either
* shared (Beagle, EAGLE-1/2): the target's frozen lm_head over the whole vocabulary; or
* its own ("EAGLE-3: Scaling up Inference Acceleration of Large Language Models via Training-Time
  Test" §3; docs/serving.md): ``norm`` then a trainable ``lm_head`` over a draft vocabulary of
  ``draft_vocab_size`` target ids, with ``d2t`` (offsets: target id = draft id + d2t[draft id])
  and ``t2d`` (which target ids the draft can emit), initialised from the target's lm_head rows.
A block draft ("DFlash: Block Diffusion for Flash Speculative Decoding" §3) keeps its trainable final
``norm`` in front of either head.

The frozen tensors are non-persistent buffers: they are not trainable, not sharded by FSDP, not
saved with the draft (a draft references its target), and they take the compute dtype
(``set_frozen_dtype``). ``teacher_weight`` holds the target's lm_head rows of the draft vocabulary
— what the training losses compare against (the same tensor as the shared head when there is no
draft vocabulary).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdraft.configs.draft import DraftConfig
from specdraft.models.layers import RMSNorm
from specdraft.vocab import vocab_maps

FROZEN = ("embed_weight", "lm_head_weight", "teacher_rows")  # non-persistent buffers holding the target's tensors


class Heads(nn.Module):
    def __init__(self, config: DraftConfig):
        super().__init__()
        self.config = config
        self.register_buffer("embed_weight", torch.empty(0), persistent=False)
        # the shared head IS the teacher; an own vocabulary keeps the teacher's rows of its ids separately
        self.register_buffer("teacher_rows" if config.own_vocab else "lm_head_weight", torch.empty(0), persistent=False)
        if config.head_norm:  # an own head, and every block draft (its final norm precedes the head)
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.own_vocab:
            self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
            self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))

    # -- attaching the target ---------------------------------------------------------------
    @property
    def attached(self) -> bool:
        return self.embed_weight.numel() > 0

    def attach(self, embed: torch.Tensor, lm_head: torch.Tensor | None, *, init_head: bool = False) -> None:
        """Take the target's embedding and lm_head (both (V, d_target)); copy the draft head's initial
        rows from the teacher when ``init_head`` (a fresh draft with its own vocabulary). A draft with
        its own vocabulary runs without the target's lm_head (``None``): only training needs it."""
        cfg = self.config
        assert embed.shape == (cfg.vocab_size, cfg.hidden_size), (
            f"target embedding {tuple(embed.shape)} != (vocab_size, hidden_size) {(cfg.vocab_size, cfg.hidden_size)}"
        )
        assert lm_head is not None or cfg.own_vocab, "a draft without its own vocabulary needs the target's lm_head"
        assert lm_head is None or lm_head.shape[0] == cfg.vocab_size, (
            f"target lm_head {tuple(lm_head.shape)} has the wrong vocabulary (vocab_size {cfg.vocab_size})"
        )
        self.embed_weight = embed.detach()
        if cfg.own_vocab:
            if lm_head is not None:
                self.teacher_rows = lm_head.detach()[self.target_ids().to(lm_head.device)]  # (Vd, d_target)
            if init_head and self.teacher_rows.shape[-1] == cfg.hidden_size:
                with torch.no_grad():
                    self.lm_head.weight.copy_(self.teacher_rows)
        else:
            self.lm_head_weight = lm_head.detach()

    def set_vocab(self, target_ids: torch.Tensor) -> None:
        """Set ``d2t``/``t2d`` from the draft vocabulary's target ids (Vd,), sorted ascending."""
        cfg = self.config
        assert cfg.own_vocab, "this draft predicts over the target's whole vocabulary"
        ids = torch.as_tensor(target_ids, dtype=torch.int64).flatten()
        assert ids.numel() == cfg.draft_vocab_size, f"{ids.numel()} ids for draft_vocab_size {cfg.draft_vocab_size}"
        assert bool((ids[1:] > ids[:-1]).all()), "draft vocabulary ids must be strictly increasing"
        assert 0 <= int(ids[0]) and int(ids[-1]) < cfg.vocab_size, "draft vocabulary ids outside the target vocabulary"
        d2t, t2d = vocab_maps(ids, cfg.vocab_size)
        with torch.no_grad():
            self.d2t.copy_(d2t)
            self.t2d.copy_(t2d)

    def set_frozen_dtype(self, dtype: torch.dtype) -> None:
        """Keep the frozen target tensors in the compute dtype (e.g. bf16 on GPU)."""
        for name, buf in list(self.named_buffers(recurse=False)):
            if name in FROZEN:
                setattr(self, name, buf.to(dtype))

    @property
    def teacher_weight(self) -> torch.Tensor:
        """The target's lm_head rows of the output vocabulary (Vd, d_target): what the losses compare with."""
        return self.teacher_rows if self.config.own_vocab else self.lm_head_weight

    # -- reading and predicting ---------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert self.attached, "the draft has no target embedding: attach the target's heads first"
        return F.embedding(input_ids, self.embed_weight)  # (..., d)

    def target_ids(self) -> torch.Tensor:
        """Target id of every output index (Vd,) (the identity without a draft vocabulary)."""
        if not self.config.own_vocab:
            return torch.arange(self.config.vocab_size, device=self.embed_weight.device)
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t  # (Vd,)

    def head_input(self, h: torch.Tensor) -> torch.Tensor:
        """What the output projection consumes: norm(h) with an own head or a block draft, else h."""
        return self.norm(h) if self.config.head_norm else h

    @property
    def weight(self) -> torch.Tensor:
        """Output projection (Vd, d): the trainable draft head, or the target's frozen lm_head."""
        return self.lm_head.weight if self.config.own_vocab else self.lm_head_weight

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits over the output vocabulary (..., Vd) (draft ids; ``target_ids`` maps them)."""
        x = self.head_input(h)
        return F.linear(x, self.weight.to(x.dtype))  # (..., Vd)
