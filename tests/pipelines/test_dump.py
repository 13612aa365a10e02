"""Tests for pipelines.dump: features vs an independent forward, accounting, resume, CLI.

Tiny random Llama / Qwen2 / Mistral models (hidden 64, 2 layers) sharing a small toy-style
tokenizer, plus a tiny toy target; the session's local Ray (tests/conftest.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pipelines.configs import DumpConfig
from pipelines.dump import dump_features
from specdraft.config import ConfigError
from pipelines.ingest import load_conversations
from specdraft import store
from specdraft.chat import render_with_loss_mask
from specdraft.features import prefill_batches
from specdraft.configs.features import FeaturesConfig
from specdraft.store import FeatureDataset, StoreError, plan_shards
from specdraft.configs.reader import ReaderConfig
from specdraft.targets.loading import load_target_model, load_tokenizer
from specdraft.toy.build import build_toy_target
from specdraft.configs.toy import ToyTargetConfig
from specdraft.toy.conversations import generate_conversations
from specdraft.toy.tokenizer import train_tokenizer
from tests.dump_checks import assert_resumed_like, complete_shards
from tests.tiny_models import FAMILIES, TINY

TOY = ToyTargetConfig(num_conversations=200, vocab_size=300, hidden_size=32, num_layers=2, num_heads=2,
                      num_kv_heads=1, intermediate_size=64, max_seq_len=64, train_steps=3, batch_size=8,
                      warmup_steps=1, num_eval_conversations=8)
CFG = FeaturesConfig(samples_per_shard=4, max_length=96, batch_tokens=400, max_batch_size=6)
SHARDS = 6  # 22 unique ids

# one xdist worker runs the whole module (``--dist loadfile``, tests/conftest.py): its module-scoped dumps (one per
# family, parametrized) are made once, not once per worker that draws one of their tests


def conversations(n: int = 18, seed: int = 7) -> list[dict]:
    rows = [{"id": f"conv-{i:03d}", "messages": m} for i, m in enumerate(generate_conversations(n, seed))]
    long = [{"role": "user", "content": "count"}, {"role": "assistant", "content": "one two " * 60}]
    return rows + [
        {"id": "x-long", "messages": long},  # truncated to max_length
        {"id": "x-noloss", "messages": [{"role": "user", "content": "hello"}]},
        {"id": "x-unrenderable", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]},
        {"id": "conv-001", "messages": rows[2]["messages"]},  # duplicate id: first one wins
    ]


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """family -> target directory (random tiny models + one tiny toy target)."""
    root = tmp_path_factory.mktemp("targets")
    texts = [m["content"] for c in generate_conversations(200, 0) for m in c]
    tokenizer = train_tokenizer(texts, vocab_size=256)
    dirs = {}
    for family, (config_cls, model_cls) in FAMILIES.items():
        torch.manual_seed(0)
        config = config_cls(**TINY, vocab_size=len(tokenizer), tie_word_embeddings=False,
                            pad_token_id=tokenizer.pad_token_id)
        model_cls(config).save_pretrained(root / family)
        tokenizer.save_pretrained(root / family)
        dirs[family] = root / family
    dirs["toy"] = build_toy_target(root / "toy", TOY, progress=False)
    return dirs


def dump_into(tmp_path_factory, target: Path, name: str):
    out = tmp_path_factory.mktemp(f"store-{name}")
    return target, out, dump_features(target, conversations(), out, CFG, progress=False)


@pytest.fixture(scope="module")
def toy_store(local_ray, targets, tmp_path_factory):
    """The toy target's store: checked like the others, and the reference for resume and CLI."""
    return dump_into(tmp_path_factory, targets["toy"], "toy")


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral", "toy"])
def dumped(request, local_ray, targets, tmp_path_factory):
    if request.param == "toy":
        return request.getfixturevalue("toy_store")
    return dump_into(tmp_path_factory, targets[request.param], request.param)


# --- planning / batching ---------------------------------------------------------------------


def test_plan_is_sorted_fixed_size_and_deduplicated():
    rows = conversations()
    plan, duplicates = plan_shards(rows[::-1], 8)
    again, _ = plan_shards(rows, 8)
    assert duplicates == 1 and [p["plan_digest"] for p in plan] == [p["plan_digest"] for p in again]
    ids = [s["id"] for p in plan for s in json.loads(p["samples"])]
    assert ids == sorted(set(r["id"] for r in rows)) and [len(json.loads(p["samples"])) for p in plan] == [8, 8, 5]


def test_load_conversations_keeps_parquet_and_ingests_raw_files(tmp_path):
    from pipelines.conversations import write_conversations

    parquet = write_conversations(tmp_path / "regen.parquet", [{**r, "source": "regen"} for r in conversations()[:3]])
    chat = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]
    raw = tmp_path / "share.json"
    raw.write_text(json.dumps([{"id": "a", "conversations": chat}, {"id": "b", "conversations": chat}]))
    rows, ingested = load_conversations([parquet, raw])
    assert [r["id"] for r in rows] == ["conv-000", "conv-001", "conv-002", "share:a"]
    assert rows[-1]["messages"] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert ingested["rows_in"] == 2 and ingested["rejects_by_reason"] == {"duplicate": 1}
    assert load_conversations([parquet])[1] is None


def test_prefill_batches_group_by_length_within_budget():
    lengths = [5, 40, 7, 39, 6, 100, 8]
    batches = prefill_batches(lengths, batch_tokens=80, max_batch_size=3)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) == 1 or (len(b) <= 3 and max(lengths[i] for i in b) * len(b) <= 80)
    assert [5] in batches and {1, 3} in [set(b) for b in batches]


# --- the dumped features ----------------------------------------------------------------------


def test_summary_accounts_for_every_row(dumped):
    _, out, s = dumped
    assert s["rows_in"] == len(conversations())
    assert s["rows_in"] == s["rows_out"] + sum(s["rejected"].values()) + s["duplicate_ids"]
    assert s["rejected"] == {"unrenderable": 1, "too_long": 0, "no_loss_tokens": 1} and s["duplicate_ids"] == 1
    assert s["truncated"] >= 1 and s["nonfinite_tokens"] == 0
    assert s["shards"] == SHARDS and s["shards_written"] == SHARDS and s["tokens_per_s"] > 0
    assert s["bytes_per_token_reference"] == 2 * store.read_manifest(out)["d"] + 6 * 10 + 5
    # where the time went: every step's seconds summed over the shards, the start's cost, the batches' padding
    phases = s["phases_s"]
    steps = ("tokenize_s", "pad_s", "forward_s", "topk_s", "copy_s", "encode_s", "check_s", "actor_s", "write_s")
    assert all(phases[k] >= 0 for k in steps) and phases["forward_s"] > 0
    assert phases["features_s"] == pytest.approx(phases["forward_s"] + phases["topk_s"], abs=1e-2)
    assert phases["actor_s"] >= phases["features_s"] + phases["encode_s"]
    assert 0 < phases["first_shard_s"] <= s["wall_s"] and 0 <= phases["ray_connect_s"] < s["wall_s"]
    assert 0 < s["padding_efficiency"] <= 1
    report = store.validate(out)
    assert report.ok, report.problems
    assert report.num_tokens == s["tokens"]


@torch.no_grad()
def test_features_equal_an_independent_forward(dumped):
    target, out, _ = dumped
    tokenizer, model = load_tokenizer(target), load_target_model(target)
    manifest = store.read_manifest(out)
    assert manifest["target_id"].startswith(Path(target).name) and manifest["hidden_codec"] == "fp16"
    messages = {r["id"]: r["messages"] for r in conversations()[:-1]}
    ds = FeatureDataset(out, ReaderConfig(max_tokens=4096), split="all")
    assert sorted(ds.sample_ids) == sorted(set(messages) - {"x-noloss", "x-unrenderable"})
    ids_agree = ids_total = 0
    for i, sid in enumerate(ds.sample_ids):
        batch = ds.load([i])
        rendered = render_with_loss_mask(tokenizer, messages[sid], max_length=CFG.max_length)
        ids = torch.tensor([rendered.input_ids])  # (1, T)
        assert batch.input_ids.tolist() == ids.tolist() and batch.valid.all()
        assert batch.loss_mask[0].tolist() == [bool(m) for m in rendered.loss_mask]
        hidden = model.model(input_ids=ids).last_hidden_state[0]  # (T, d)
        logits = model(input_ids=ids).logits[0]  # (T, V)
        torch.testing.assert_close(batch.hidden[0], hidden, atol=2e-3, rtol=2e-3)  # fp16 storage
        # top-K: the stored ids carry the K largest logits (ties aside), probabilities are exact
        kth = logits.topk(10, dim=-1).values[:, -1:]  # (T, 1)
        stored_logits = logits.gather(-1, batch.topk_ids[0])  # (T, K)
        assert (stored_logits >= kth - 1e-3).all()
        ids_agree += int((batch.topk_ids[0] == logits.topk(10, dim=-1).indices).all(-1).sum())
        ids_total += ids.shape[1]
        probs = torch.softmax(logits, -1).gather(-1, batch.topk_ids[0])  # (T, K)
        torch.testing.assert_close(batch.topk_logp[0].exp(), probs, atol=2e-3, rtol=2e-3)
    assert ids_agree / ids_total > 0.98


def test_raw_arrays_follow_the_schema(dumped):
    import zarr

    _, out, _ = dumped
    manifest = store.read_manifest(out)
    d = manifest["d"]
    group = zarr.open_group(str(out / store.shard_name(0)), mode="r", zarr_format=3)
    n = group["input_ids"].shape[0]
    expect = {"input_ids": ("int32", (n,)), "loss_mask": ("uint8", (n,)), "hidden": ("float16", (n, d)),
              "topk_ids": ("int32", (n, 10)), "topk_logits": ("float16", (n, 10)), "logsumexp": ("float32", (n,)),
              "offsets": ("int64", (5,))}
    for name, (dtype, shape) in expect.items():
        assert (str(group[name].dtype), group[name].shape) == (dtype, shape), name
    assert group["sample_ids"].shape == (4,) and group["hidden"].chunks[0] <= CFG.chunk_tokens


# --- resume ---------------------------------------------------------------------------------


def test_killed_dump_resumes_to_the_same_store(toy_store, tmp_path):
    target, reference_dir, reference = toy_store
    rows = conversations()
    out = tmp_path / "resumed"
    with pytest.raises(Exception, match="injected fault while writing shard 3"):
        dump_features(target, rows, out, CFG, progress=False, fault_at_shard=3)
    finals, temps = store.list_shard_dirs(out)
    assert not (out / store.MANIFEST_FILE).exists() and 3 not in finals
    assert any(t.name.startswith(".shard-00003.zarr.tmp-") for t in temps)
    with pytest.raises(StoreError, match="incomplete"):
        FeatureDataset(out)
    kept = complete_shards(out)
    assert kept.keys() == finals.keys()

    summary = dump_features(target, rows, out, CFG, progress=False)
    assert reference["shards"] == SHARDS and summary["shards_kept"] >= len(kept)
    # the placement: the shards written now (not the kept ones), each by the one local node
    assert [sorted(n["shards"]) for n in summary["nodes"]] == [sorted(set(range(SHARDS)) - set(kept))]
    assert_resumed_like(out, summary, reference_dir, reference, kept)

    again = dump_features(target, rows, out, CFG, progress=False)  # complete: nothing to do
    assert again["shards_written"] == 0 and again["shards_kept"] == SHARDS and again["tokens"] == reference["tokens"]
    with pytest.raises(StoreError, match="another dump"):
        dump_features(target, rows, out, FeaturesConfig(samples_per_shard=4, topk=5), progress=False)


def test_a_write_ray_runs_again_keeps_the_shard_its_first_attempt_finished(toy_store):
    """Ray re-runs a write whose node was lost after the shard was final (its result lost with the node): the
    writer returns the shard's record and leaves it as it is; another plan's shard, or none, is written."""
    from pipelines.dump import ZarrShardDatasink

    _, out, _ = toy_store
    manifest = store.read_manifest(out)
    sink = ZarrShardDatasink(out, manifest, CFG, kept=[])
    shard = store.list_shard_dirs(out)[0][2]
    record, inode = store.read_shard_record(shard), shard.stat().st_ino
    again = sink.write_row({"meta": json.dumps({"index": 2, "plan_digest": record["plan_digest"], "node": None})})
    assert again == {**record, "node": None} and shard.stat().st_ino == inode  # kept, not rewritten
    assert sink.already_written(2, "another plan") is None and sink.already_written(SHARDS, record["plan_digest"]) is None


@pytest.mark.slow  # restarts Ray (its workers need the endpoint), two dumps
def test_killed_dump_to_s3_resumes_to_the_same_store(toy_store, s3_bucket, s3_ray):
    """At an object-store URL (a real S3 server on 127.0.0.1): no rename, so the dead writer's keys sit
    under the shard's final name without its record; resume deletes and rewrites them."""
    target, reference_dir, reference = toy_store
    rows, out = conversations(), f"{s3_bucket}/features/toy"
    with pytest.raises(Exception, match="injected fault while writing shard 3"):
        dump_features(target, rows, out, CFG, progress=False, fault_at_shard=3)
    finals, temps = store.list_shard_dirs(out)
    assert 3 in finals and temps == [] and not store.location.exists(f"{out}/{store.MANIFEST_FILE}")
    with pytest.raises(StoreError, match="not a complete shard"):
        store.read_shard_record(finals[3])
    with pytest.raises(StoreError, match="incomplete"):
        FeatureDataset(out)
    complete = complete_shards(out)  # shard 3's keys without its record are not complete
    assert 3 not in complete and len(complete) < len(finals)

    summary = dump_features(target, rows, out, CFG, progress=False)
    assert summary["shards_kept"] == len(complete)
    assert_resumed_like(out, summary, reference_dir, reference, complete)


# --- CLI and lossy codec -----------------------------------------------------------------------


def test_cli_dump_int8_and_validate_store(toy_store, tmp_path, capsys):
    from flows.cli import main
    from pipelines.conversations import write_conversations

    target, fp16, _ = toy_store
    prompts = write_conversations(tmp_path / "convs.parquet", [{**r, "source": "test"} for r in conversations()[:18]])
    int8 = tmp_path / "int8"
    argv = ["dump", "--target", str(target), "--prompts", str(prompts), "--out", str(int8), "--quiet",
            "samples_per_shard=4", "max_length=96", "batch_tokens=400", "max_batch_size=6", "hidden_codec=int8"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["lossy"] is True and summary["rows_out"] == 18 and summary["hidden_codec"] == "int8"
    a = FeatureDataset(fp16, ReaderConfig(max_tokens=4096), split="all")
    b = FeatureDataset(int8, ReaderConfig(max_tokens=4096), split="all")
    for j, sid in enumerate(b.sample_ids):
        x, y = a.load([a.sample_ids.index(sid)]), b.load([j])
        bound = x.hidden.abs().amax(-1, keepdim=True) / 254 + 2e-3  # (1, T, 1): half a step + fp16
        assert ((x.hidden - y.hidden).abs() <= bound).all()
        assert torch.equal(x.topk_ids, y.topk_ids) and torch.equal(x.topk_logp, y.topk_logp)

    assert main(["validate-store", str(int8), "--quiet"]) == 0

    # prompts without answers: nothing to learn from, a failing exit with the fix, not a quiet empty store
    asked = [{**r, "source": "test", "messages": [m for m in r["messages"] if m["role"] != "assistant"][:1]}
             for r in conversations()[:3]]
    capsys.readouterr()
    argv = ["dump", "--target", str(target), "--prompts", str(write_conversations(tmp_path / "asked.parquet", asked)),
            "--out", str(tmp_path / "asked"), "--quiet", "samples_per_shard=4", "max_length=96"]
    assert main(argv) == 1
    assert "specdraft regenerate" in capsys.readouterr().err

    chunk = next(p for p in (int8 / store.shard_name(1) / "hidden" / "c").rglob("*") if p.is_file())
    chunk.write_bytes(chunk.read_bytes()[:10])
    capsys.readouterr()
    assert main(["validate-store", str(int8), "--quiet"]) == 1
    assert "shard-00001.zarr/hidden" in capsys.readouterr().out


def test_manifest_records_the_attention_kernel_and_placement(toy_store):
    """The requested kernel is in the manifest's features, the one each actor used (with its
    dtype and devices) in every shard record; kernel and GPU spread are not part of features_hash."""
    from specdraft.features import features_hash

    _, out, _ = toy_store
    manifest = store.read_manifest(out)
    assert manifest["features"]["attn_implementation"] == "sdpa" and manifest["features"]["gpus_per_actor"] == 1.0
    for shard in manifest["shards"]:
        assert shard["placement"] == {"attn_implementation": "sdpa", "dtype": "float32", "devices": ["cpu"],
                                      "input_device": "cpu", "output_device": "cpu"}
    assert features_hash(DumpConfig(attn_implementation="eager", gpus_per_actor=4)) == features_hash(FeaturesConfig())
    with pytest.raises(ConfigError, match="fraction <= 1"):
        DumpConfig(gpus_per_actor=1.5)


def test_a_prefill_actor_asks_ray_for_the_memory_it_uses(targets):
    """``actor_memory``: the process, the weights (their parameters counted from the safetensors headers, here
    checked against the loaded model) and one full prefill batch's states at the inference dtype, with one
    ``logits_chunk`` block of logits (chunk, V) at that dtype and in float32 (never more rows than a batch)."""
    from pipelines.dump import PROCESS_BYTES, actor_memory, parameter_count
    from specdraft.targets.loading import load_target_config, load_target_model

    target = targets["llama"]
    params = sum(p.numel() for p in load_target_model(target).state_dict().values())
    assert parameter_count(target) == params
    config = load_target_config(target)
    v, d, n = config.vocab_size, config.hidden_size, config.num_hidden_layers
    cfg = DumpConfig(batch_tokens=512, logits_chunk=128)
    assert actor_memory(target, cfg, use_gpu=False) == PROCESS_BYTES + 4 * (params + 512 * 2 * d + 128 * v) + 4 * 128 * v
    eagle3 = DumpConfig(batch_tokens=512, logits_chunk=128, aux_layers="eagle3")  # every layer's states kept
    assert (actor_memory(target, eagle3, use_gpu=False)
            == PROCESS_BYTES + 4 * (params + 512 * (n + 1) * d + 128 * v) + 4 * 128 * v)
    half = DumpConfig(batch_tokens=512, logits_chunk=128, dtype="bfloat16")
    assert actor_memory(target, half, use_gpu=False) == PROCESS_BYTES + 2 * (params + 512 * 2 * d + 128 * v) + 4 * 128 * v
    small = DumpConfig(batch_tokens=64, logits_chunk=2048)  # a chunk never holds more rows than a batch
    assert actor_memory(target, small, use_gpu=False) == PROCESS_BYTES + 4 * (params + 64 * 2 * d + 64 * v) + 4 * 64 * v
    assert actor_memory(target, cfg, use_gpu=True) == PROCESS_BYTES  # weights and batch in GPU memory


# --- auxiliary layers (EAGLE-3 features) ----------------------------------------------------------


@pytest.fixture(scope="module")
def deep_llama(targets, tmp_path_factory) -> Path:
    """A tiny Llama of 8 layers: aux_layers=eagle3 picks the states entering layers 2, 4 and 5."""
    root = tmp_path_factory.mktemp("deep") / "llama8"
    tokenizer = load_tokenizer(targets["llama"])
    torch.manual_seed(1)
    config = LlamaConfig(**{**TINY, "num_hidden_layers": 8}, vocab_size=len(tokenizer), tie_word_embeddings=False,
                         pad_token_id=tokenizer.pad_token_id)
    LlamaForCausalLM(config).save_pretrained(root)
    tokenizer.save_pretrained(root)
    return root


@torch.no_grad()
def test_cli_dump_eagle3_aux_layers(local_ray, deep_llama, tmp_path, capsys):
    """``specdraft dump ... aux_layers=eagle3``: the manifest records the layer ids and their convention,
    aux_hidden equals decoding's target features, validate checks it, resume refuses other layers."""
    from dataclasses import replace

    from transformers import DynamicCache

    from flows.cli import main
    from pipelines.conversations import write_conversations
    from specdraft.decoding.verify import target_forward

    rows = conversations()[:18]
    prompts = write_conversations(tmp_path / "convs.parquet", [{**r, "source": "test"} for r in rows])
    out = tmp_path / "eagle3"
    argv = ["dump", "--target", str(deep_llama), "--prompts", str(prompts), "--out", str(out), "--quiet",
            "samples_per_shard=4", "max_length=96", "batch_tokens=400", "max_batch_size=6", "aux_layers=eagle3"]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["aux_layers"] == [2, 4, 5] and summary["rows_out"] == 18
    assert summary["bytes_per_token_reference"] == 2 * 64 * 4 + 6 * 10 + 5  # hidden + 3 aux layers
    manifest = store.read_manifest(out)
    assert manifest["aux_layers"] == [2, 4, 5] and manifest["features"]["aux_layers"] == "eagle3"
    assert manifest["aux_convention"].startswith("hf_hidden_states_index")
    assert all(r["aux_layers"] == [2, 4, 5] and "aux_hidden" in r["checksums"] for r in manifest["shards"])
    assert store.validate(out).ok

    model = load_target_model(deep_llama)
    ds = FeatureDataset(out, ReaderConfig(max_tokens=4096), split="all", aux_layers=(2, 4, 5))
    for i in range(len(ds.sample_ids)):
        batch = ds.load([i]).to("cpu")
        t = batch.input_ids.shape[1]
        aux, _ = target_forward(model, batch.input_ids, torch.arange(t)[None], DynamicCache(), aux_layers=[2, 4, 5])
        torch.testing.assert_close(batch.aux_hidden, aux, atol=2e-3, rtol=2e-3)  # fp16 storage
    assert FeatureDataset(out, ReaderConfig(), split="all").load([0]).aux_hidden is None

    cfg = replace(CFG, aux_layers=[2, 4, 5])  # the same layers spelled out: the same store, nothing redone
    assert dump_features(deep_llama, rows, out, cfg, progress=False)["shards_written"] == 0
    with pytest.raises(StoreError, match=r"dumped with aux_layers \[2, 4, 5\], this config asks for \[1, 3\]"):
        dump_features(deep_llama, rows, out, replace(CFG, aux_layers=[1, 3]), progress=False)
    with pytest.raises(StoreError, match=r"dumped with aux_layers \[2, 4, 5\], this config asks for \[\]"):
        dump_features(deep_llama, rows, out, CFG, progress=False)
    chunk = next(p for p in (out / store.shard_name(0) / "aux_hidden" / "c").rglob("*") if p.is_file())
    chunk.write_bytes(chunk.read_bytes()[:10])
    assert any(p.startswith("shard-00000.zarr/aux_hidden") for p in store.validate(out).problems)


def test_eagle3_on_the_3_layer_toy_target_takes_its_nearest_distinct_layers_and_says_which(local_ray, tmp_path,
                                                                                           capsys):
    """The default toy target has 3 layers, too few for the states entering layers 2, N/2, N-3: ``aux_layers=eagle3``
    stores the three distinct states it has, [0, 1, 2], with a warning naming them, instead of an error."""
    from flows.cli import main
    from pipelines.conversations import write_conversations

    target = build_toy_target(tmp_path / "toy", ToyTargetConfig(), progress=False, prebuilt=True)
    assert json.loads((target / "config.json").read_text())["num_hidden_layers"] == 3
    rows = [{"id": f"c{i}", "messages": m, "source": "test"} for i, m in enumerate(generate_conversations(4, 5))]
    prompts = write_conversations(tmp_path / "convs.parquet", rows)
    out = tmp_path / "eagle3"
    argv = ["dump", "--target", str(target), "--prompts", str(prompts), "--out", str(out), "--quiet", "max_length=96",
            "aux_layers=eagle3"]
    with pytest.warns(UserWarning, match=r"N=3-layer target; using the nearest distinct ones, \[0, 1, 2\]"):
        assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["aux_layers"] == [0, 1, 2]
    manifest = store.read_manifest(out)
    assert manifest["aux_layers"] == [0, 1, 2] and all("aux_hidden" in r["checksums"] for r in manifest["shards"])


def test_a_target_without_chat_template_is_dumped_with_the_fallback_not_rejected(templateless_target):
    from pipelines.dump import tokenize_shard
    from specdraft.chat import FALLBACK_CHAT_TEMPLATE

    rows = [{"id": f"c{i}", "messages": m} for i, m in enumerate(generate_conversations(6, 7))]
    batch = {"index": np.array([0]), "plan_digest": np.array(["p"]), "samples": np.array([json.dumps(rows)])}
    out = tokenize_shard(batch, str(templateless_target), FeaturesConfig(max_length=4096))
    meta = json.loads(str(out["meta"][0]))
    assert meta["rejected"] == {"unrenderable": 0, "too_long": 0, "no_loss_tokens": 0}
    assert meta["sample_ids"] == [r["id"] for r in rows]
    tokenizer = load_tokenizer(templateless_target)
    assert tokenizer.chat_template == FALLBACK_CHAT_TEMPLATE
    first = render_with_loss_mask(tokenizer, rows[0]["messages"])
    assert first.text.count("### Assistant:\n") == sum(m["role"] == "assistant" for m in rows[0]["messages"])
    n = len(first.input_ids)
    assert out["input_ids"][0][:n].tolist() == first.input_ids and out["loss_mask"][0][:n].tolist() == first.loss_mask
