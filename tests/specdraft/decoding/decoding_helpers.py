"""Shared test helpers: tiny HF targets, drafts, stub target/draft with fixed logits, chi-square.

``exact_joint`` enumerates the exact distribution of the first few sampled tokens (chi-square
tests of lossless sampling).

Stubs (litgpt-style stub-model tests for speculative acceptance):
* ``StubTarget`` — an HF-shaped causal LM whose argmax at position p is ``seq[p + 1]``
  whatever the context; it writes its positions into the ``DynamicCache`` so compaction is
  observable.
* ``StubDraft`` — a Beagle-shaped draft whose top-1 at query position p is ``seq[p + 1]``
  except at ``wrong`` positions, where a distractor is top-1 and ``seq[p + 1]`` is second.
"""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import torch
from torch import nn
from transformers import DynamicCache

from specdraft.decoding.sampling import target_probs
from specdraft.decoding.verify import target_forward
from specdraft.models import KV, build_draft, draft_config_from_target
from specdraft.configs.draft import DraftConfig
from tests.tiny_models import FAMILIES
from tests.tiny_models import TINY as SHAPE

TINY = {**SHAPE, "vocab_size": 128}


def tiny_target(family: str = "llama", seed: int = 0, logit_scale: float = 1.0, **overrides):
    """A random tiny target (fp32, eval); ``logit_scale`` sharpens its next-token distributions."""
    config_cls, model_cls = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**TINY, **overrides}, tie_word_embeddings=False)).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    return model


def tiny_draft(target, arch: str, seed: int = 1, draft_vocab: int = 100):
    """A random draft sharing the target's embedding and lm_head.

    ``eagle3`` / ``beagle3``: reads the target's hidden_states 0, 1, 2 and predicts over a random
    draft vocabulary of ``draft_vocab`` target ids. ``dflash``: a 2-layer block draft (blocks of 5) over
    hidden_states 0, 1, 2 with the target's head; ``dflash-vocab`` with a draft vocabulary.
    """
    torch.manual_seed(seed)
    own = arch in ("eagle3", "beagle3", "dflash-vocab")
    feats = own or arch == "dflash"
    vocab = torch.randperm(target.config.vocab_size)[:draft_vocab].sort().values if own else None
    base = {"beagle3": "beagle", "dflash-vocab": "dflash"}.get(arch, arch)
    blocks = dict(num_layers=2, block_size=5) if base == "dflash" else {}
    cfg = draft_config_from_target(target.config, base, aux_layers=[0, 1, 2] if feats else None,
                                   draft_vocab_size=draft_vocab if own else None, **blocks)
    draft = build_draft(cfg, embed=target.get_input_embeddings().weight, lm_head=target.lm_head.weight, vocab=vocab)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if p.requires_grad and p.dim() >= 2:
                p.mul_(3.0)  # louder than the default init so the draft's choices depend on context
    return draft.eval()


# --------------------------------------------------------------------------- stubs


class _StubDecoder(nn.Module):
    def __init__(self, seq: torch.Tensor, vocab: int):
        super().__init__()
        self.seq, self.vocab = seq, vocab

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=True, **_):
        pos = position_ids[0]  # (Q,)
        hidden = 10.0 * nn.functional.one_hot(self.seq[pos + 1], self.vocab).float()[None]  # (1, Q, V)
        if past_key_values is not None:
            marker = pos.float().view(1, 1, -1, 1)  # (1, 1, Q, 1): the cache remembers positions
            past_key_values.update(marker, marker, 0)
        return SimpleNamespace(last_hidden_state=hidden)


class StubTarget(nn.Module):
    """Argmax at position p is ``seq[p + 1]`` (independent of the context)."""

    def __init__(self, seq: list[int], vocab: int):
        super().__init__()
        self.decoder = _StubDecoder(torch.tensor(seq), vocab)
        self.lm_head = nn.Linear(vocab, vocab, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(torch.eye(vocab))
        self.config = SimpleNamespace(final_logit_softcapping=None, sliding_window=None)

    def get_decoder(self):
        return self.decoder

    def get_output_embeddings(self):
        return self.lm_head


class StubDraft(nn.Module):
    """Beagle-shaped draft: top-1 at query position p is seq[p+1] unless p+1 is in ``wrong``."""

    def __init__(self, seq: list[int], vocab: int, wrong=lambda pos: False):
        super().__init__()
        self.seq, self.vocab, self.wrong = list(seq), vocab, wrong
        self.dummy = nn.Parameter(torch.zeros(1))
        self.config = DraftConfig(arch="beagle", vocab_size=vocab, hidden_size=vocab, num_attention_heads=1,
                                  num_key_value_heads=1, head_dim=1, intermediate_size=1)

    def project(self, features):
        return features

    def encode_states(self, states, positions):
        z = torch.zeros(1, 1, states.shape[1], 1)
        return KV(z, z)

    def encode_committed(self, tokens, states, start):
        return tokens[:, -1:], self.encode_states(states, None)

    def encode_nodes(self, tokens, parent_states, positions):
        return tokens, None

    def encode_drafted(self, h, positions):
        return self.encode_states(h, positions)

    def attend(self, input_ids, positions, kv, visible, extra=None):
        rows = []
        for p in positions[0].tolist():
            right = self.seq[p + 1]
            row = torch.full((self.vocab,), -30.0)
            if self.wrong(p + 1):
                row[(right + 1) % self.vocab] = 0.0
                row[right] = -1.0
            else:
                row[right] = 0.0
                row[(right + 1) % self.vocab] = -1.0
            rows.append(row)
        return torch.stack(rows)[None]  # (1, Q, V)

    def logits(self, h):
        return h


class StubBlockDraft(nn.Module):
    """Block-draft-shaped stub: block position k from a root at n proposes seq[n + k] unless n + k is in
    ``wrong``, where a distractor is top-1 and seq[n + k] second."""

    def __init__(self, seq: list[int], vocab: int, block_size: int = 6, wrong=lambda pos: False):
        super().__init__()
        self.seq, self.vocab, self.wrong = list(seq), vocab, wrong
        self.dummy = nn.Parameter(torch.zeros(1))
        self.config = DraftConfig(arch="dflash", vocab_size=vocab, hidden_size=vocab, num_attention_heads=1,
                                  num_key_value_heads=1, head_dim=1, intermediate_size=1, aux_layers=[0],
                                  block_size=block_size, mask_token_id=0)

    def project(self, features):
        return features

    def context_kv(self, states, positions):
        z = torch.zeros(1, 1, states.shape[1], 1)
        return [KV(z, z)]

    def draft_block(self, anchor, position, context, size=None):
        rows = []
        for p in range(position, position + (size or self.config.block_size)):
            right = self.seq[p]
            row = torch.full((self.vocab,), -30.0)
            row[(right + 1) % self.vocab if self.wrong(p) else right] = 0.0
            row[right if self.wrong(p) else (right + 1) % self.vocab] = -1.0
            rows.append(row)
        return torch.stack(rows)[None]  # (1, S, V)

    def logits(self, h):
        return h


# --------------------------------------------------------------------------- statistics


def _gamma_q(a: float, x: float) -> float:
    """Regularized upper incomplete gamma Q(a, x) (series / Lentz continued fraction)."""
    if x <= 0:
        return 1.0
    log_prefix = -x + a * math.log(x) - math.lgamma(a)
    if x < a + 1:  # P(a, x) by its series
        term = total = 1.0 / a
        ap = a
        for _ in range(10_000):
            ap += 1
            term *= x / ap
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        return max(0.0, 1.0 - total * math.exp(log_prefix))
    tiny = 1e-300
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            break
    return math.exp(log_prefix) * h


def chi2_sf(stat: float, df: int) -> float:
    """Survival function of the chi-square distribution with ``df`` degrees of freedom."""
    return _gamma_q(df / 2.0, stat / 2.0)


def chi2_gof(counts: dict, probs: dict, min_expected: float = 5.0) -> tuple[float, int, float]:
    """Pearson goodness of fit of observed ``counts`` to exact ``probs`` (cells with expected
    count below ``min_expected`` are pooled); returns (statistic, df, p-value)."""
    n = sum(counts.values())
    assert set(counts) <= set(probs), f"observed outcomes with zero probability: {set(counts) - set(probs)}"
    cells, pooled_obs, pooled_exp = [], 0.0, 0.0
    for key, p in probs.items():
        e, o = n * p, counts.get(key, 0)
        if e >= min_expected:
            cells.append((o, e))
        else:
            pooled_obs, pooled_exp = pooled_obs + o, pooled_exp + e
    if pooled_exp > 0:
        cells.append((pooled_obs, pooled_exp))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    df = len(cells) - 1
    return stat, df, chi2_sf(stat, df)


def exact_joint(target, cfg, prompt: list[int], steps: int) -> dict[tuple[int, ...], float]:
    """P(x_1..x_steps | prompt) under the warped target (``SamplingConfig`` ``cfg``), by enumeration
    over its whole (tiny) vocabulary."""
    vocab = target.get_output_embeddings().weight.shape[0]

    def probs(prefix):
        ids = torch.tensor([list(prompt) + list(prefix)])
        _, logits = target_forward(target, ids, torch.arange(ids.shape[1])[None], DynamicCache())
        return target_probs(logits[0, -1], cfg).tolist()

    out = {}
    cond = {(): probs(())}
    for seq in itertools.product(range(vocab), repeat=steps):
        p = 1.0
        for i in range(steps):
            prefix = seq[:i]
            if prefix not in cond:
                cond[prefix] = probs(prefix)
            p *= cond[prefix][seq[i]]
        if p > 0:
            out[seq] = p
    return out


def random_tree(n: int, vocab: int, seed: int):
    """A random parents-first DraftTree of ``n`` nodes (node 0 the root)."""
    import random

    from specdraft.decoding.tree import DraftTree, ancestors_from_parents

    rng = random.Random(seed)
    parents = [-1] + [rng.randrange(i) for i in range(1, n)]
    depths = [0] * n
    for i in range(1, n):
        depths[i] = depths[parents[i]] + 1
    p = torch.tensor(parents)
    return DraftTree(
        tokens=torch.tensor([rng.randrange(vocab) for _ in range(n)]),
        parents=p,
        depths=torch.tensor(depths),
        ancestors=ancestors_from_parents(p),
        scores=torch.zeros(n, dtype=torch.float64),
    )
