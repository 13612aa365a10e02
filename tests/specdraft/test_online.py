"""Online features (specdraft.online) against the store reader: same sequences, same batches, same values
(auxiliary layers included), same draft-vocabulary counts, same first-step loss (EAGLE-3 too). The store is
written with the store's own writer from the toy targets' features, one forward per sequence (what a dump
with one-sequence prefill batches stores); the dump stage itself (Ray Data) is compared in
tests/pipelines/test_train.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdraft.chat import render_with_loss_mask, tokenize_conversations
from specdraft.features import prefill_features, resolve_aux_layers
from specdraft.models import build_draft, draft_config_from_target
from specdraft.configs.stages import LossWeights, StageConfig
from specdraft.online import OnlineDataset
from specdraft.store import (
    FeatureDataset,
    encode_hidden,
    make_manifest,
    predicted_token_counts,
    write_manifest,
    write_shard,
)
from specdraft.configs.reader import ReaderConfig
from specdraft.targets.loading import load_target_config, load_target_heads, load_target_model, load_tokenizer
from specdraft.toy.conversations import generate_conversations
from specdraft.training import Trainer
from specdraft.configs.train import OptimConfig
from specdraft.vocab import select_vocab

TOPK = 6


def rows() -> list[dict]:
    convs = [{"id": f"c{i:02d}", "messages": m} for i, m in enumerate(generate_conversations(20, seed=11))]
    return list(reversed(convs)) + [  # input order must not matter: ids are sorted
        {"id": "c03", "messages": convs[5]["messages"]},  # duplicate id: the first row wins
        {"id": "x-noloss", "messages": [{"role": "user", "content": "hello"}]},
        {"id": "x-unrenderable", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]},
        {"id": "x-long", "messages": [{"role": "user", "content": "count"},
                                      {"role": "assistant", "content": "one two " * 60}]},
    ]


@pytest.fixture(scope="module")
def toy(tiny_toy_target):
    torch.set_num_threads(1)  # the same kernels for the store's forward and the online one
    model, tokenizer = load_target_model(tiny_toy_target), load_tokenizer(tiny_toy_target)
    return tiny_toy_target, model, tokenizer, tokenize_conversations(tokenizer, rows(), max_length=96)


def write_store(path, model, data, codec: str, aux_layers: list[int] = ()):
    """A two-shard store of ``data``, each sequence's features from its own forward (as the dump stores them),
    with ``aux_layers`` their states as ``aux_hidden`` (int8: one scale per token and layer)."""
    records = []
    halves = [range(0, len(data) // 2), range(len(data) // 2, len(data))]
    for index, part in enumerate(halves):
        hidden, top_i, top_v, lse, aux = [], [], [], [], []
        for i in part:
            ids = torch.tensor([data.input_ids[i]])  # (1, L)
            f = prefill_features(model, ids, torch.ones_like(ids), TOPK, aux_layers=aux_layers)
            hidden.append(f.hidden), top_i.append(f.topk_ids), top_v.append(f.topk_logits), lse.append(f.logsumexp)
            aux.append(f.aux_hidden)
        lengths = [len(data.input_ids[i]) for i in part]
        arrays = {
            **encode_hidden(torch.cat(hidden), codec),
            **(encode_hidden(torch.cat(aux), codec, name="aux_hidden", parts=len(aux_layers)) if aux_layers else {}),
            "input_ids": np.concatenate([data.input_ids[i] for i in part]).astype(np.int32),
            "loss_mask": np.concatenate([data.loss_mask[i] for i in part]).astype(np.uint8),
            "topk_ids": torch.cat(top_i).numpy().astype(np.int32),
            "topk_logits": torch.cat(top_v).to(torch.float16).numpy(),
            "logsumexp": torch.cat(lse).numpy(),
            "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            "sample_ids": np.array([data.sample_ids[i] for i in part]),
        }
        attrs = {"d": model.config.hidden_size, "k": TOPK, "hidden_codec": codec, "aux_layers": list(aux_layers)}
        records.append(write_shard(path, index, arrays, attrs))
    header = {"target_id": "toy", "d": model.config.hidden_size, "k": TOPK, "hidden_codec": codec,
              "aux_layers": list(aux_layers)}
    write_manifest(path, make_manifest(header=header, shards=records))
    return path


def assert_same_batch(offline, online, exact: bool, codec: str) -> None:
    for name in offline.__dataclass_fields__:
        a, b = getattr(offline, name), getattr(online, name)
        assert (a is None) == (b is None), name
        if a is None:
            continue
        if exact or not a.dtype.is_floating_point:
            assert torch.equal(a, b), name
        else:  # another batch shape moves float32 results by a few ulp: a float16/bf16 hidden absorbs nearly all
            # of it (int8's float32 scale does not); topk_logp = float16 logit - float32 logsumexp moves by those
            # ulp (or, rarely, by one float16 ulp of the logit: 2**-10 relative)
            if name in ("hidden", "aux_hidden") and codec != "int8":
                assert (a == b).float().mean() > 0.99, name
            torch.testing.assert_close(b, a, rtol=2**-10, atol=1e-2)


def test_tokenize_conversations_orders_and_rejects_as_the_dump(toy):
    _, _, tokenizer, data = toy
    first: dict[str, list] = {}
    for row in rows():
        first.setdefault(row["id"], row["messages"])
    assert data.sample_ids == sorted(set(first) - {"x-noloss", "x-unrenderable"})
    assert data.duplicates == 1 and data.rejected == {"unrenderable": 1, "too_long": 0, "no_loss_tokens": 1}
    rendered = {i: render_with_loss_mask(tokenizer, first[i]) for i in data.sample_ids}
    assert data.truncated == sum(len(r.input_ids) > 96 for r in rendered.values()) >= 1
    for i, ids, mask in zip(data.sample_ids, data.input_ids, data.loss_mask):
        assert (ids, mask) == (rendered[i].input_ids[:96], rendered[i].loss_mask[:96]), i


@pytest.mark.parametrize("codec", ["fp16", "bf16", "int8"])
def test_online_batches_equal_the_stored_ones(toy, tmp_path, codec):
    """Auxiliary layers included (both of the toy's: 0 = the embeddings, 1), in the store's codec."""
    _, model, _, data = toy
    store = write_store(tmp_path / "store", model, data, codec, aux_layers=[0, 1])
    for max_tokens, exact in ((1, True), (500, False)):  # one sequence per batch: the store's forward shapes
        for split in ("train", "val"):
            for world in (1, 2):
                for rank in range(world):
                    cfg = ReaderConfig(max_tokens=max_tokens, val_fraction=0.25, seed=3, max_length=80)
                    offline = FeatureDataset(store, cfg, split=split, rank=rank, world_size=world, aux_layers=[0, 1])
                    online = OnlineDataset(model, data, cfg, topk=TOPK, hidden_codec=codec, split=split, rank=rank,
                                           world_size=world, aux_layers=[0, 1])
                    assert online.sample_ids == offline.sample_ids
                    assert online.load(online.batches(0)[0]).aux_hidden.shape[-1] == 2 * model.config.hidden_size
                    for epoch in (0, 1):
                        assert online.batches(epoch) == offline.batches(epoch) and len(online) == len(offline)
                    for seqs in offline.batches(0):
                        assert_same_batch(offline.load(seqs), online.load(seqs), exact, codec)


@pytest.mark.parametrize("arch,stage", [
    ("beagle", StageConfig(kind="early", epochs=1, window=3, noise_std=0.2, loss=LossWeights(ce=1.0, vloss=10.0))),
    ("eagle", StageConfig(kind="align", epochs=1, steps=2, noise_std=0.2,
                          loss=LossWeights(ce=1.0, topk=1.0, vloss=10.0))),
])
@pytest.mark.parametrize("max_tokens", [1, 400])
def test_first_step_loss_is_the_same_online_and_offline(toy, tmp_path, arch, stage, max_tokens):
    """One sequence per batch: the store's forward shapes, the same loss to the last bit. Several: float16
    rounding absorbs the batch shape's float32 differences (measured: equal here too), bounded by 1e-5."""
    target, model, _, data = toy
    store = write_store(tmp_path / "store", model, data, "fp16")
    heads, tconf = load_target_heads(target), load_target_config(target)
    reader = ReaderConfig(max_tokens=max_tokens, seed=0)
    losses = []
    for dataset in (FeatureDataset(store, reader), OnlineDataset(model, data, reader, topk=TOPK)):
        torch.manual_seed(0)
        draft = build_draft(draft_config_from_target(tconf, arch), heads.embed, heads.lm_head)
        losses.append(first_two_losses(draft, stage, dataset))
    assert len(losses[0]) == 2 and losses[0][0] > 0
    assert losses[1] == pytest.approx(losses[0], abs=1e-6 if max_tokens == 1 else 1e-5, rel=0)


def first_two_losses(draft, stage, dataset) -> list[float]:
    """The losses of the first two optimizer steps of ``stage`` on ``dataset``'s first two batches."""
    trainer = Trainer(draft, [stage], OptimConfig(lr=1e-3, warmup_steps=0), len(dataset.batches(0)), seed=0)
    steps = []
    trainer.run(lambda s, e: [dataset.load(b) for b in dataset.batches(e)[:2]],
                on_step=lambda tr, metrics: steps.append(metrics["loss"]))
    return steps


@pytest.fixture(scope="module")
def deep(deep_toy_target):
    torch.set_num_threads(1)
    model, tokenizer = load_target_model(deep_toy_target), load_tokenizer(deep_toy_target)
    return deep_toy_target, model, tokenize_conversations(tokenizer, rows(), max_length=96)


@pytest.mark.parametrize("max_tokens", [1, 400])
def test_eagle3_first_step_loss_is_the_same_online_and_offline(deep, tmp_path, max_tokens):
    """recipe eagle3's stage (training-time test) on the aux layers ``eagle3`` picks for a 7-layer target, over
    a draft vocabulary counted from the store and from the tokenized conversations (the same counts)."""
    target, model, data = deep
    layers = resolve_aux_layers("eagle3", model.config.num_hidden_layers)
    assert layers == [2, 3, 4]
    store = write_store(tmp_path / "store", model, data, "int8", aux_layers=layers)
    vocab_size = model.config.vocab_size
    counts = data.predicted_token_counts(vocab_size)
    assert counts.sum() > 0 and np.array_equal(counts, predicted_token_counts(store, vocab_size))
    vocab = select_vocab(counts, 48)
    heads, tconf = load_target_heads(target), load_target_config(target)
    stage = StageConfig(kind="ttt", epochs=1, steps=3, step_decay=0.8, noise_std=0.0, loss=LossWeights(ce=1.0))
    reader = ReaderConfig(max_tokens=max_tokens, seed=0)
    losses = []
    for dataset in (FeatureDataset(store, reader, aux_layers=layers),
                    OnlineDataset(model, data, reader, topk=TOPK, hidden_codec="int8", aux_layers=layers)):
        torch.manual_seed(0)
        dcfg = draft_config_from_target(tconf, "eagle3", aux_layers=layers, draft_vocab_size=vocab.numel())
        draft = build_draft(dcfg, heads.embed, heads.lm_head, vocab=vocab)
        losses.append(first_two_losses(draft, stage, dataset))
    assert len(losses[0]) == 2 and losses[0][0] > 0
    assert losses[1] == pytest.approx(losses[0], abs=1e-6 if max_tokens == 1 else 1e-5, rel=0)


def test_dflash_first_step_loss_is_the_same_online_and_offline(toy, tmp_path):
    """recipe dflash's block stage (anchors from the trainer's seeded stream) over the auxiliary layers, from a
    store and online: the same first two losses."""
    target, model, _, data = toy
    store = write_store(tmp_path / "store", model, data, "fp16", aux_layers=[0, 1])
    heads, tconf = load_target_heads(target), load_target_config(target)
    stage = StageConfig(kind="block", epochs=1, anchors=6, step_decay=0.87, noise_std=0.0, loss=LossWeights(ce=1.0))
    reader = ReaderConfig(max_tokens=400, seed=0)
    losses = []
    for dataset in (FeatureDataset(store, reader, aux_layers=[0, 1]), OnlineDataset(model, data, reader, topk=TOPK, aux_layers=[0, 1])):
        torch.manual_seed(0)
        dcfg = draft_config_from_target(tconf, "dflash", aux_layers=[0, 1], num_layers=2, block_size=4)
        losses.append(first_two_losses(build_draft(dcfg, heads.embed, heads.lm_head), stage, dataset))
    assert len(losses[0]) == 2 and losses[0][0] > 0
    assert losses[1] == pytest.approx(losses[0], abs=1e-5, rel=0)


def test_online_dataset_checks_its_arguments(toy):
    _, model, _, data = toy
    with pytest.raises(AssertionError, match="hidden codec"):
        OnlineDataset(model, data, topk=TOPK, hidden_codec="fp8")
    with pytest.raises(AssertionError, match="rank"):
        OnlineDataset(model, data, topk=TOPK, rank=2, world_size=2)
