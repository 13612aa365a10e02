"""Drafting with a block draft: one draft forward per round fills a whole block ("DFlash: Block
Diffusion for Flash Speculative Decoding" §3, Fig. 2: parallel drafting, then the target verifies
the block as a chain).

The draft keeps one cache per layer of the committed context's keys/values (the projected target
features of every committed position, §3.1's KV injection); a round runs the block — the root (the
last committed token t_n, the block's anchor at position n) and γ masks at n+1 .. n+γ — over that
cache, and block position k proposes the token at n + k. The γ tokens form a chain (``DraftTree`` with
``chain=True``, its tokens left on the device: the loop's one host read per round stays the acceptance's):
greedy takes each position's argmax; sampling draws each position's token
from its own (warped) distribution q_k, kept as the node's proposal. The block's positions do not see
the tokens drafted beside them (they see only mask tokens), so q_k is the proposal of depth k whatever
was drawn before it, and verification's rejection sampling stays exact. ``advance`` appends the
target's features of the accepted tokens to the cache; nothing drafted is ever cached.

γ: the block's S-1 masked positions, or fewer in ``chain`` mode with ``gamma`` < S-1 (a shorter
block: vLLM's ``num_speculative_tokens``). A block draft proposes no tree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdraft.decoding.drafting import target_logprobs
from specdraft.decoding.sampling import draw, target_probs
from specdraft.configs.decode import SamplingConfig
from specdraft.decoding.tree import DraftTree, chain_structure
from specdraft.models.kvcache import KVCache


@dataclass
class BlockContext:
    """A block draft's state between rounds: per-layer caches of the committed context, and the root."""

    caches: list[KVCache]  # one per draft layer: keys/values of the projected target features 0 .. n-1
    root_pos: int  # n: the root token's position (the next block's anchor)
    root_token: int


@dataclass(frozen=True, slots=True)
class BlockDrafter:
    """A block draft (``DFlashDraft``) as a ``speculative.Drafter``: one block per round."""

    draft: torch.nn.Module
    gamma: int  # drafted tokens per round (the block's masked positions)
    sampling: SamplingConfig
    max_new_tokens: int = 0  # sizes the caches up front (0: they grow by doubling)

    @property
    def max_depth(self) -> int:
        return self.gamma

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return tuple(self.draft.config.aux_layers)

    def _extend(self, state: BlockContext, features: torch.Tensor, start: int) -> None:
        param = next(self.draft.parameters())
        states = self.draft.project(features.to(param.device, param.dtype))  # (1, m, d)
        positions = torch.arange(start, start + states.shape[1], device=param.device)[None]  # (1, m)
        for cache, kv in zip(state.caches, self.draft.context_kv(states, positions)):
            cache.append(kv)

    def start(self, prompt_ids: torch.Tensor, features: torch.Tensor, first_token: int) -> BlockContext:
        n = prompt_ids.shape[1]
        assert features.shape[:2] == (1, n), f"features {tuple(features.shape)} do not match {n} prompt tokens"
        capacity = n + self.max_new_tokens + self.gamma + 1 if self.max_new_tokens else 0
        state = BlockContext([KVCache(capacity) for _ in range(self.draft.config.num_layers)], n, int(first_token))
        self._extend(state, features, 0)
        return state

    @torch.no_grad()
    def propose(self, state: BlockContext, generator: torch.Generator | None) -> DraftTree:
        context = [cache.view() for cache in state.caches]
        h = self.draft.draft_block(state.root_token, state.root_pos, context, size=self.gamma + 1)  # (1, 1+γ, d)
        logp = target_logprobs(self.draft, self.draft.logits(h[0, 1:]))  # (γ, V)
        tokens = torch.empty(self.gamma + 1, dtype=torch.long, device=logp.device)  # (1+γ,): left on the device
        tokens[0].fill_(state.root_token)  # a fill, not a copy from the host
        proposals = None
        if self.sampling.greedy:
            tokens[1:] = logp.argmax(-1)
        else:
            q = target_probs(logp, self.sampling)  # (γ, V)
            for k, row in enumerate(q):  # one draw per position, in order (the generator's stream)
                tokens[k + 1] = draw(row, generator)
            proposals = torch.cat([torch.zeros_like(q[:1]), q])  # (1+γ, V); row 0 unused
        parents, depths, ancestors, zeros = chain_structure(self.gamma, logp.device)
        return DraftTree(tokens=tokens, parents=parents, depths=depths, ancestors=ancestors, scores=zeros,
                         proposals=proposals, height=self.gamma, chain=True)

    def advance(self, state: BlockContext, tokens: list[int], features: torch.Tensor) -> None:
        """Commit ``tokens`` (accepted drafts + the next root); ``features`` (1, m, F) are the target's at the
        old root and the accepted drafts, positions n .. n+m-1."""
        m = len(tokens)
        assert m >= 1 and features.shape[:2] == (1, m), f"{m} tokens but features {tuple(features.shape)}"
        self._extend(state, features, state.root_pos)
        state.root_pos += m
        state.root_token = int(tokens[-1])


def block_gamma(draft: torch.nn.Module, cfg) -> int:
    """Tokens a block draft proposes per round under the decode settings ``cfg``: the block's S-1 masked
    positions, or ``gamma`` when a chain of fewer is asked for."""
    masked = draft.config.block_size - 1
    return min(cfg.gamma, masked) if cfg.mode == "chain" else masked
