"""Ray Train job: learning on a toy store, FSDP == DDP == accumulation, DDP/FSDP gradient sync and
sharding, resume after a failure (two FSDP workers; one worker: tests/faults/test_results.py).

Reference runs that are not about workers run in Ray Train's local mode (``scaling.num_workers=0``:
the same training loop in the test's process), saving a worker group's start-up each."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from mlflow.tracking import MlflowClient

from pipelines.tracking import MlflowLogger
from pipelines.train import run_training
from specdraft.batch import Batch
from specdraft.features import compute_features, sample_arrays
from specdraft.models import build_draft, draft_config_from_target, load_draft
from specdraft.configs.draft import DraftConfig
from specdraft.configs.stages import LossWeights, StageConfig
from pipelines.configs import ClusterTrainConfig, ScalingSection
from specdraft.run import validate_draft
from specdraft.store import FeatureDataset, make_manifest, write_manifest, write_shard
from specdraft.configs.reader import ReaderConfig
from specdraft.targets.loading import load_target_config, load_target_heads, load_target_model, load_tokenizer
from specdraft.toy.conversations import generate_conversations
from specdraft.configs.train import OptimConfig

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def toy_store(tiny_toy_target, tmp_path_factory) -> Path:
    """A two-shard feature store of the tiny toy target, written with the store's own writer."""
    model, tok = load_target_model(tiny_toy_target), load_tokenizer(tiny_toy_target)
    samples = compute_features(model, tok, generate_conversations(96, seed=5), 128, 10, progress=False)
    d = samples[0]["hidden"].shape[-1]
    out = tmp_path_factory.mktemp("store")
    records = []
    for index, part in enumerate([samples[:48], samples[48:]]):
        arrays = sample_arrays(part, [f"s{index}-{i}" for i in range(len(part))])
        records.append(write_shard(out, index, arrays, {"d": d, "k": 10, "hidden_codec": "fp16"}))
    write_manifest(out, make_manifest(header={"target_id": "toy", "d": d, "k": 10, "hidden_codec": "fp16"},
                                      shards=records))
    return out


def small_config(**kw) -> ClusterTrainConfig:
    base = dict(
        recipe="beagle", epochs=[2, 1], seed=0, checkpoint_every=4, sim_depth=4, log_every=1000,
        optim=OptimConfig(lr=3e-3, warmup_steps=5, schedule="cosine", min_lr_ratio=0.1),
        reader=ReaderConfig(max_tokens=2048, val_fraction=0.2, seed=0),
    )
    base.update(kw)
    return ClusterTrainConfig(**base)


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_training_learns_and_writes_a_loadable_draft(local_ray, tiny_toy_target, toy_store, tmp_path):
    # the default min_steps (300): batches shrink until the run has them; few checkpoints (each report waits
    # for Ray Train's controller to poll)
    cfg = small_config(epochs=[3, 1], checkpoint_every=100, reader=ReaderConfig(max_tokens=768, val_fraction=0.2, seed=0))
    run = MlflowLogger(f"sqlite:///{tmp_path / 'mlflow.db'}", experiment="train-test", run_name="train")
    summary = run_training(cfg, [toy_store], tiny_toy_target, tmp_path / "run",
                           tracking={"uri": run.uri, "run_id": run.run_id})
    run.close()
    draft = load_draft(summary["draft"], target=tiny_toy_target)
    logged = MlflowClient(run.uri).get_run(run.run_id).data
    assert logged.params["train.recipe"] == "beagle" and "sim_tau" in logged.metrics and "loss" in logged.metrics
    records = [r for r in read_metrics(tmp_path / "run") if r["kind"] == "metrics"]
    early = [r["loss"] for r in records if r.get("stage") == 0.0]  # the late stage sums 4 weighted steps
    assert np.mean(early[-3:]) < np.mean(early[:3])

    heads = load_target_heads(tiny_toy_target)
    torch.manual_seed(0)
    untrained = build_draft(draft_config_from_target(load_target_config(tiny_toy_target), "beagle"),
                            heads.embed, heads.lm_head)
    val = FeatureDataset([toy_store], cfg.reader, split="val")
    before = validate_draft(untrained, val, 4, 100, "cpu").sim_tau
    after = validate_draft(draft, val, 4, 100, "cpu").sim_tau
    assert after > before + 0.05, (before, after)
    sim = [r["sim_tau"] for r in records if "sim_tau" in r]
    assert len(sim) == 4  # one validation pass per epoch

    # the run's Ray logs (every worker, the train controller and its placement-group cleaner) hold
    # none of the known-harmless lines (pipelines/cluster.py) and no traceback of a crashed monitor
    logs = Path(local_ray._private.worker._global_node.get_session_dir_path()) / "logs"
    text = "".join(p.read_text(errors="ignore") for p in logs.glob("worker-*") if p.is_file())
    assert text  # the workers' logs are there to read
    for line in ("Failed to query Ray Train Controller actor state", "Failed to send resource request",
                 "Found multiple active Ray instances", "Exception in thread PlacementGroupCleanerMonitor"):
        assert line not in text, line


def even_reader(store: Path) -> ReaderConfig:
    """A reader whose global batch plan has an even count and is the same for 1 and 2 workers, so a
    2-worker run trains on exactly the batches of a 1-worker run with grad_accum 2."""
    for max_tokens in (1024, 896, 768, 640, 512):
        reader = ReaderConfig(max_tokens=max_tokens, val_fraction=0.0, seed=0, shuffle=False)
        plan = FeatureDataset([store], reader).global_batches(0)
        if len(plan) % 2 == 0 and FeatureDataset([store], reader, world_size=2).global_batches(0) == plan:
            return reader
    pytest.fail("no batch size gives an even batch count")


def grad_norms(out: Path) -> list[float]:
    return [r["grad_norm"] for r in read_metrics(out) if "grad_norm" in r]


def train_steps(out: Path) -> list[dict]:
    """The optimizer steps' records of a run, in order (a resumed run appends to its killed run's)."""
    return [r for r in read_metrics(out) if r["kind"] == "metrics" and "grad_norm" in r]


def test_fsdp_ddp_and_one_worker_accumulating_train_the_same_weights(local_ray, tiny_toy_target, toy_store, tmp_path):
    """2 workers sharded (FSDP2) == 2 workers replicated (DDP) == grad_accum 2 in one process, with the
    gradients clipped on every step (so a per-shard norm would show), through a detached multi-step
    stage (align), then ttt (several forwards, one backward) on an EAGLE draft, and ttt again with each
    sub-step's decoder layer recomputed in the backward (activation checkpointing inside FSDP)."""
    stages = [StageConfig(kind="align", epochs=1, steps=2, noise_std=0.0, loss=LossWeights(ce=1.0, vloss=1.0)),
              StageConfig(kind="ttt", epochs=1, steps=3, step_decay=0.8, noise_std=0.0,
                          loss=LossWeights(ce=1.0, vloss=1.0)),
              StageConfig(kind="ttt", epochs=1, steps=3, step_decay=0.8, noise_std=0.0, recompute=True,
                          loss=LossWeights(ce=1.0, vloss=1.0))]
    optim = dict(lr=3e-3, warmup_steps=2, max_grad_norm=0.2)
    common = dict(arch="eagle", stages=stages, epochs=None, checkpoint_every=0, min_steps=1, val_max_batches=2,
                  reader=even_reader(toy_store))
    runs = {
        strategy: small_config(**common, optim=OptimConfig(**optim),
                               scaling=ScalingSection(num_workers=2, strategy=strategy))
        for strategy in ("fsdp", "ddp")
    }
    # the reference in Ray Train's local mode (num_workers=0: the same loop, in this process)
    runs["one"] = small_config(**common, optim=OptimConfig(**optim, grad_accum=2),
                               scaling=ScalingSection(num_workers=0))
    drafts = {name: load_draft(run_training(cfg, [toy_store], tiny_toy_target, tmp_path / name)["draft"],
                               target=tiny_toy_target) for name, cfg in runs.items()}
    norms = {name: grad_norms(tmp_path / name) for name in runs}
    assert len(norms["one"]) >= 12 and min(norms["one"]) > 0.2, norms["one"]  # all three stages, always clipped
    reference = drafts["one"].state_dict()
    for name in ("fsdp", "ddp"):
        assert norms[name] == pytest.approx(norms["one"], rel=1e-4), name  # the global norm, not a shard's
        weights = drafts[name].state_dict()
        assert weights.keys() == reference.keys()
        for key, value in reference.items():
            assert torch.allclose(weights[key], value, atol=1e-5, rtol=1e-4), (name, key)


def test_fsdp_run_resumes_from_a_checkpoint_after_a_failure(local_ray, tiny_toy_target, toy_store, tmp_path):
    """The Beagle recipe (noise, random window offsets per rank) on 2 FSDP workers, killed after a
    checkpoint, resumes from it: the steps it re-does repeat the killed run's exactly (loss, global gradient
    norm, learning rate: weights, optimizer, schedule, data order and every rank's random streams restored
    from the checkpoint), and it ends at the planned step count. (One worker restarted by Ray Train after a
    failure is compared with an uninterrupted run in tests/faults/test_results.py.)"""
    cfg = small_config(min_steps=1, val_max_batches=2, checkpoint_every=3, epochs=[1, 1],
                       reader=ReaderConfig(max_tokens=1024, val_fraction=0.2, seed=0),
                       scaling=ScalingSection(num_workers=2, strategy="fsdp"))
    with pytest.raises(Exception, match="injected failure"):
        run_training(cfg, [toy_store], tiny_toy_target, tmp_path / "run", fail_at_step=5)
    before = train_steps(tmp_path / "run")
    resumed = run_training(cfg, [toy_store], tiny_toy_target, tmp_path / "run")
    steps = train_steps(tmp_path / "run")  # one row per step: the killed run's after the checkpoint were dropped
    assert [r["step"] for r in steps] == list(range(1, len(steps) + 1))
    after = [r for r in steps if r not in before]  # the resumed run's rows
    killed = {r["step"]: r for r in before}
    redone = [r for r in after if r["step"] in killed]  # after the last checkpoint (every 3 steps, each epoch end)
    assert sorted(killed) == [1, 2, 3, 4, 5] and 3 < after[0]["step"] <= 5 and redone, (sorted(killed), after[0])
    for again in redone:
        for key in ("loss", "grad_norm", "lr"):
            assert again[key] == pytest.approx(killed[again["step"]][key], rel=1e-6, abs=1e-7), (again["step"], key)
    planned = next(r for r in read_metrics(tmp_path / "run") if r["kind"] == "params")["train.total_steps"]
    assert resumed["metrics"]["state_step"] == after[-1]["step"] == planned > 5
    load_draft(resumed["draft"], target=tiny_toy_target)


@pytest.fixture(scope="module")
def one_worker_run(local_ray, tiny_toy_target, toy_store, tmp_path_factory) -> dict:
    """An uninterrupted run of ``small_config(min_steps=1)`` (the store's own batches: a few steps, noise
    and random window offsets, a checkpoint every 4), in Ray Train's local mode (``num_workers=0``: the
    same training loop in this process; the tests compare it with runs in a Ray Train worker)."""
    cfg = small_config(min_steps=1, scaling=ScalingSection(num_workers=0))
    return run_training(cfg, [toy_store], tiny_toy_target, tmp_path_factory.mktemp("one"))


def same_weights(a: str | Path, b: str | Path, target: Path, atol: float) -> None:
    da, db = load_draft(a, target=target).state_dict(), load_draft(b, target=target).state_dict()
    assert da.keys() == db.keys()
    for name, value in da.items():
        assert torch.allclose(value, db[name], atol=atol, rtol=0), name


def test_eagle3_recipe_trains_on_a_store_dumped_with_aux_layers(local_ray, tiny_toy_target, toy_store, tmp_path):
    """recipe eagle3 end to end: the dump stores aux_hidden, the reader fills Batch.aux_hidden (reader
    with the run plan's aux layers), training runs and writes an EAGLE-3 draft; a store
    without aux states is refused up front with the fix."""
    from pipelines.dump import dump_features
    from specdraft.configs.features import FeaturesConfig
    from specdraft.store import StoreError

    rows = [{"id": f"c{i}", "messages": m} for i, m in enumerate(generate_conversations(24, seed=9))]
    store = tmp_path / "aux-store"
    dump_features(tiny_toy_target, rows, store, FeaturesConfig(samples_per_shard=12, max_length=128, aux_layers=[0, 1]),
                  progress=False)
    cfg = small_config(recipe="eagle3", epochs=[1], min_steps=4, draft_vocab_size=64, checkpoint_every=0,
                       reader=ReaderConfig(max_tokens=1024, val_fraction=0.2, seed=0),
                       scaling=ScalingSection(num_workers=0))  # Ray Train's local mode: the loop in this process
    summary = run_training(cfg, [store], tiny_toy_target, tmp_path / "run")
    draft = load_draft(summary["draft"], target=tiny_toy_target)
    assert draft.config.arch == "eagle3" and draft.config.aux_layers == [0, 1] and draft.config.draft_vocab_size == 64
    losses = [r["loss"] for r in read_metrics(tmp_path / "run") if r["kind"] == "metrics" and "loss" in r]
    assert len(losses) >= 4 and all(np.isfinite(losses))
    with pytest.raises(StoreError, match="recipe 'eagle3' .* has no aux_hidden .* aux_layers=eagle3"):
        run_training(cfg, [toy_store], tiny_toy_target, tmp_path / "bare")
    block = replace(cfg, recipe="dflash", draft_layers=1, block_size=4)  # the block draft, on the same store
    summary = run_training(block, [store], tiny_toy_target, tmp_path / "block")
    draft = load_draft(summary["draft"], target=tiny_toy_target)
    assert draft.config.arch == "dflash" and draft.config.aux_layers == [0, 1] and draft.config.block_size == 4
    assert not draft.config.own_vocab and not (tmp_path / "block" / "draft_vocab.json").exists()  # the target's head
    rows = [r for r in read_metrics(tmp_path / "block") if r["kind"] == "metrics" and "loss" in r]
    assert len(rows) >= 4 and all(np.isfinite(r["loss"]) for r in rows) and "acc_step3" in rows[-1]



def test_online_feature_plan_resolves_the_aux_layers_and_counts_the_vocabulary(tiny_toy_target, tmp_path):
    """On the driver, no Ray: train.online.aux_layers resolved as the dump resolves it (eagle3 does not fit a
    2-layer target: the error names the setting), the draft vocabulary counted from the tokenized
    conversations, written to out/draft_vocab.json and reused from there on resume."""
    from pipelines.conversations import write_conversations
    from specdraft.configs.features import FeaturesConfig
    from pipelines.train import feature_plan, online_conversations
    from specdraft.vocab import select_vocab

    rows = [{"id": f"c{i:03d}", "source": "toy", "messages": m} for i, m in enumerate(generate_conversations(12, 2))]
    conversations = write_conversations(tmp_path / "conversations.parquet", rows)
    cfg = small_config(recipe="eagle3", epochs=[1], features="online", conversations=[str(conversations)],
                       draft_vocab_size=32,
                       online=FeaturesConfig(max_length=96, aux_layers="eagle3"))
    with pytest.raises(ValueError, match=r"train.online.aux_layers='eagle3'.*N=2 layers"):
        feature_plan(cfg, [], tiny_toy_target, tmp_path)
    cfg = replace(cfg, online=replace(cfg.online, aux_layers=[0, 1]))
    layers, ids = feature_plan(cfg, [], tiny_toy_target, tmp_path)
    counts = online_conversations(cfg, tiny_toy_target)[0].predicted_token_counts(320)
    assert layers == [0, 1] and ids == select_vocab(counts, 32).tolist()
    record = json.loads((tmp_path / "draft_vocab.json").read_text())
    assert record["target_ids"] == ids and record["counted_tokens"] == counts.sum() > 0
    assert record["size"] == 32 and record["vocab_size"] == 320  # what the summary's vocab line says
    assert record["coverage"] == pytest.approx(counts[ids].sum() / counts.sum()) and 0 < record["coverage"] < 1
    (tmp_path / "draft_vocab.json").write_text(json.dumps({**record, "target_ids": list(range(32))}))
    assert feature_plan(cfg, [], tiny_toy_target, tmp_path) == ([0, 1], list(range(32)))  # resumed: kept

# -- gradient sync and sharding inside real Ray Train workers (gloo), on tiny drafts without a target --
TV, TD = 53, 32


def tiny_draft(arch: str):
    """The same draft on every rank and call: random frozen heads; eagle3 with its own 41-token head; dflash a
    2-layer block draft (blocks of 4) with the target's head."""
    torch.manual_seed(0)
    own, block = arch == "eagle3", arch == "dflash"
    cfg = DraftConfig(arch=arch, vocab_size=TV, hidden_size=TD, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=16, intermediate_size=64, aux_layers=[1, 2] if own or block else [],
                      draft_vocab_size=41 if own else None,
                      **(dict(num_layers=2, block_size=4, mask_token_id=0) if block else {}))
    g = torch.Generator().manual_seed(1)
    vocab = torch.randperm(TV, generator=g)[:41].sort().values if own else None
    embed, lm_head = torch.randn(TV, TD, generator=g), torch.randn(TV, TD, generator=g) / TD**0.5
    return build_draft(cfg, embed=embed, lm_head=lm_head, vocab=vocab)


def tiny_batch(seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(TV, (2, 12), generator=g)
    loss_mask = torch.rand(2, 12, generator=g) > 0.2
    loss_mask[:, :2] = False
    return Batch(ids, torch.randn(2, 12, TD, generator=g), loss_mask, torch.ones(2, 12, dtype=torch.bool),
                 aux_hidden=torch.randn(2, 12, 2 * TD, generator=g))


def named_grads(model) -> dict[str, torch.Tensor]:
    """Full gradients by parameter name (gathered from FSDP2 shards); collective under FSDP2."""
    out = {}
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        out[name.removeprefix("module.")] = grad.detach().clone()
    return out


def rank_mean(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    import torch.distributed as dist

    out = {}
    for name, g in grads.items():
        g = g.clone()
        dist.all_reduce(g)
        out[name] = g / dist.get_world_size()
    return out


def same_on_every_rank(x: torch.Tensor) -> bool:
    import torch.distributed as dist

    both = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(both, x.contiguous())
    return all(torch.equal(both[0], b) for b in both[1:])


def sync_worker(config: dict) -> None:
    """Each rank trains two batches of its own (grad_accum 2) through ``distribute``; asserts raise."""
    import ray.train
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.tensor import DTensor

    from specdraft.parallel import distribute, gathered
    from specdraft.acceptance import simulated_acceptance
    from specdraft.models.heads import FROZEN
    from specdraft.objectives import train_batch
    from specdraft.training import Trainer, clip_gradients
    from specdraft.configs.train import OptimConfig

    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    batches = [tiny_batch(100 * rank + i) for i in range(2)]  # different data on every rank

    # DDP: the all-reduces of the accumulation group all happen inside the last sync context
    align = StageConfig(kind="align", steps=2, noise_std=0.0, loss=LossWeights(ce=1.0, vloss=1.0))
    model, sync = distribute(tiny_draft("eagle"), "ddp", world, "cpu")
    local = tiny_draft("eagle")  # the same weights, never synchronised
    reduced, entered = [0], []

    def counting_hook(state, bucket):
        reduced[0] += 1
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, counting_hook)

    def recording_sync(enabled):
        entered.append((enabled, reduced[0]))
        return sync(enabled)

    train_batch(model, batches[0], align, scale=0.5, grad_sync=recording_sync, sync_last=False)
    train_batch(local, batches[0], align, scale=0.5)
    first = named_grads(model)
    for name, g in named_grads(local).items():
        assert torch.allclose(first[name], g, atol=1e-7), f"DDP synchronised {name} before the last sub-step"
    assert not same_on_every_rank(first["fc.weight"]), "ranks saw different data: their local grads must differ"
    train_batch(model, batches[1], align, scale=0.5, grad_sync=recording_sync, sync_last=True)
    train_batch(local, batches[1], align, scale=0.5)
    synced, mean = named_grads(model), rank_mean(named_grads(local))
    for name, g in mean.items():
        assert torch.allclose(synced[name], g, atol=1e-6), f"DDP {name} != the ranks' mean accumulated gradient"
        assert same_on_every_rank(synced[name]), name
    assert entered == [(False, 0), (False, 0), (False, 0), (True, 0)] and reduced[0] >= 1, (entered, reduced)

    # FSDP2 on an EAGLE-3 draft (own head, used outside the forward) with ttt: frozen buffers stay whole
    ttt = StageConfig(kind="ttt", steps=3, step_decay=0.8, noise_std=0.0, loss=LossWeights(ce=1.0, topk=1.0))
    model, sync = distribute(tiny_draft("eagle3"), "fsdp", world, "cpu")
    local = tiny_draft("eagle3")
    params = dict(model.named_parameters())
    assert params.keys() == dict(local.named_parameters()).keys() and "heads.lm_head.weight" in params
    assert all(isinstance(p, DTensor) for p in params.values()), "every trainable weight is sharded"
    assert not any(name.split(".")[-1] in FROZEN for name in params), "a frozen target tensor became a parameter"
    for name, buf in model.named_buffers():
        assert not isinstance(buf, DTensor) and buf.shape == local.get_buffer(name).shape, name
    assert model.heads.embed_weight.shape == (TV, TD)
    with gathered(model):  # drafting outside the forward sees the full weights
        a, b = simulated_acceptance(model, batches[0], 3), simulated_acceptance(local, batches[0], 3)
    assert torch.equal(a.accepted, b.accepted) and torch.equal(a.reached, b.reached)
    assert all(isinstance(p, DTensor) for p in model.parameters()), "resharded after gathering"
    sd = Trainer(model, [ttt], OptimConfig(), 1).draft_state_dict()  # collective; full tensors on rank 0
    if rank == 0:
        assert sd.keys() == local.state_dict().keys()
        assert all(torch.equal(sd[k], v) for k, v in local.state_dict().items())
    else:
        assert not sd

    train_batch(model, batches[0], ttt, scale=0.5, grad_sync=sync, sync_last=False)
    assert all(p.grad is None for p in model.parameters()), "FSDP reduced gradients before the last sub-step"
    train_batch(model, batches[1], ttt, scale=0.5, grad_sync=sync, sync_last=True)
    for batch in batches:
        train_batch(local, batch, ttt, scale=0.5)
    synced, mean = named_grads(model), rank_mean(named_grads(local))
    for name, g in mean.items():
        assert torch.allclose(synced[name], g, atol=1e-6), f"FSDP {name} != the ranks' mean accumulated gradient"
    # clipping sharded gradients: the global norm, and every shard scaled by the same factor
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in mean.values()]))
    got = clip_gradients(list(model.parameters()), float(norm) / 2)
    assert not isinstance(got, DTensor) and torch.allclose(got, norm, rtol=1e-5), (got, norm)
    clipped = named_grads(model)
    for name, g in mean.items():
        assert torch.allclose(clipped[name], g * (float(norm) / 2) / (float(norm) + 1e-6), atol=1e-6), name

    # FSDP2 on a DFlash block draft (block stage; its final norm, in heads, is used outside the forward)
    block = StageConfig(kind="block", anchors=3, step_decay=0.8, noise_std=0.0, loss=LossWeights(ce=1.0))
    model, sync = distribute(tiny_draft("dflash"), "fsdp", world, "cpu")
    local = tiny_draft("dflash")
    assert all(isinstance(p, DTensor) for p in model.parameters()) and "heads.norm.weight" in dict(
        model.named_parameters())
    for i, batch in enumerate(batches):  # the same anchors on both sides: seeded per rank and batch
        train_batch(model, batch, block, scale=0.5, grad_sync=sync, sync_last=i == 1,
                    generator=torch.Generator().manual_seed(10 * rank + i))
        train_batch(local, batch, block, scale=0.5, generator=torch.Generator().manual_seed(10 * rank + i))
    synced, mean = named_grads(model), rank_mean(named_grads(local))
    for name, g in mean.items():
        assert torch.allclose(synced[name], g, atol=1e-6), f"FSDP {name} != the ranks' mean accumulated gradient"
    Path(config["out"], f"passed-{rank}").touch()


def test_gradient_sync_and_sharding_in_ray_train_workers(local_ray, tmp_path):
    """DDP skips the all-reduce on all but the last sub-step of an accumulation group; FSDP2 shards the
    trainable weights only, keeps the EAGLE-3 head usable outside the forward (ttt), reduces once per
    group, clips by the global norm and gathers a full state dict on rank 0; a DFlash block draft trains
    under FSDP2 to the ranks' mean gradient."""
    import ray.cloudpickle
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # test modules are not importable by workers
    trainer = TorchTrainer(
        sync_worker,
        train_loop_config={"out": str(tmp_path)},
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name="sync", storage_path=str(tmp_path / "ray")),
    )
    result = trainer.fit()
    assert result.error is None and sorted(p.name for p in tmp_path.glob("passed-*")) == ["passed-0", "passed-1"]


def test_training_reads_a_store_from_s3_like_the_same_store_on_disk(s3_ray, s3_bucket, one_worker_run, tiny_toy_target,
                                                                    toy_store, tmp_path):
    """The store copied to an object-store URL (a real S3 server on 127.0.0.1): the Ray Train worker reads it
    there and trains the same weights, step for step, as from the local copy."""
    import fsspec

    url = f"{s3_bucket}/stores/toy"
    fsspec.filesystem("s3").put(f"{toy_store}/", url[len("s3://"):], recursive=True)
    remote = run_training(small_config(min_steps=1), [url], tiny_toy_target, tmp_path / "s3")
    local = Path(one_worker_run["draft"]).parent
    assert len(grad_norms(tmp_path / "s3")) > 0 and grad_norms(tmp_path / "s3") == pytest.approx(grad_norms(local),
                                                                                                rel=1e-6)
    same_weights(remote["draft"], one_worker_run["draft"], tiny_toy_target, atol=1e-6)


# the online-vs-store runs: recipe -> the target, the conversations (how many, seed), the dump's aux layers,
# the run's stages, Ray Train workers (0: local mode, in this process) and the draft vocabulary (None: the default)
ONLINE_VS_STORE = {
    "beagle": dict(target="tiny_toy_target", conversations=(40, 9), samples_per_shard=16, aux_layers=None,
                   epochs=[1, 1], workers=2, val_max_batches=2, draft_vocab_size=None),
    "eagle3": dict(target="deep_toy_target", conversations=(24, 4), samples_per_shard=12, aux_layers="eagle3",
                   epochs=[1], workers=0, val_max_batches=1, draft_vocab_size=64),
}


@pytest.mark.parametrize("recipe", list(ONLINE_VS_STORE))
def test_online_features_train_like_the_dumped_store(recipe, local_ray, request, tmp_path):
    """``specdraft train --recipe R --conversations`` (online features) against the dump stage's store of the
    same conversations: every rank gets the same batch plan from both, and rank 0's first step, set up as the
    worker sets it up (``build_run``: draft seed, rank-0 generator — noise, window offsets), has the online run's
    first-step loss on the store and online. Beagle on two Ray Train workers; EAGLE-3 (no aux layers configured:
    they default to eagle3) in local mode, on the 7-layer target, with the aux layers and draft vocabulary of the
    store dumped with aux_layers=eagle3. The dump prefills its own length groups, so features can differ in the
    last float bits (absorbed by the float16 rounding: measured equal); the bound is 1e-5. (In process: an
    offline Ray Train run would add half the test's time.)"""
    import yaml

    from flows.cli import main
    from pipelines.conversations import write_conversations
    from pipelines.dump import dump_features
    from pipelines.train import online_conversations
    from specdraft.config import to_dict
    from specdraft.configs.features import FeaturesConfig
    from specdraft.online import OnlineDataset
    from specdraft.plan import build_plan
    from specdraft.run import build_run
    from specdraft.store import predicted_token_counts, read_manifest
    from specdraft.vocab import select_vocab

    case = ONLINE_VS_STORE[recipe]
    target = request.getfixturevalue(case["target"])
    count, seed = case["conversations"]
    rows = [{"id": f"c{i:03d}", "source": "toy", "messages": m} for i, m in enumerate(generate_conversations(count, seed))]
    conversations = write_conversations(tmp_path / "conversations" / "part-00000.parquet", rows)
    features = FeaturesConfig(max_length=96, samples_per_shard=case["samples_per_shard"], batch_tokens=1024)
    store = tmp_path / "store"
    dump_features(target, rows, store, replace(features, aux_layers=case["aux_layers"]), progress=False)
    cfg = small_config(recipe=recipe, epochs=case["epochs"], min_steps=1, checkpoint_every=0,
                       val_max_batches=case["val_max_batches"], online=features, reader=ReaderConfig(max_tokens=512, val_fraction=0.2, seed=0),
                       scaling=ScalingSection(num_workers=case["workers"]),
                       **{k: case[k] for k in ("draft_vocab_size",) if case[k] is not None})
    (tmp_path / "train.yaml").write_text(yaml.safe_dump(to_dict(cfg)))
    argv = ["train", "--recipe", recipe, "--conversations", str(conversations.parent), "--target", str(target),
            "--out", str(tmp_path / "online"), "--config", str(tmp_path / "train.yaml")]
    assert main(argv) == 0

    draft = load_draft(tmp_path / "online" / "draft", target=target)
    records = read_metrics(tmp_path / "online")
    params = next(r for r in records if r["kind"] == "params")
    losses = [r["loss"] for r in records if r["kind"] == "metrics" and "loss" in r]
    assert params["train.features"] == "online" and params["train.max_tokens_used"] == 512
    assert draft.config.arch == recipe and all(np.isfinite(losses))
    layers, vocab = None, None
    if case["aux_layers"]:
        layers = read_manifest(store)["aux_layers"]
        assert layers == [2, 3, 4] and draft.config.aux_layers == layers
        assert params["train.online.aux_layers"] == "eagle3"
        vocab = json.loads((tmp_path / "online" / "draft_vocab.json").read_text())["target_ids"]
        assert vocab == select_vocab(predicted_token_counts(store, 320), case["draft_vocab_size"]).tolist()

    model = load_target_model(target)
    data = online_conversations(replace(cfg, conversations=[str(conversations.parent)]), target)[0]
    world = max(1, case["workers"])
    opened = {  # the split of rank ``rank`` of ``world`` on the store and online, as a worker opens it
        "store": lambda split, reader, aux, rank=0: FeatureDataset([store], reader, split=split, rank=rank,
                                                                   world_size=world, aux_layers=aux),
        "online": lambda split, reader, aux, rank=0: OnlineDataset(model, data, reader, topk=features.topk, split=split,
                                                                   rank=rank, world_size=world, aux_layers=aux),
    }
    reader, aux = cfg.reader, tuple(layers or ())
    for rank in range(world):
        offline, online = opened["store"]("train", reader, aux, rank), opened["online"]("train", reader, aux, rank)
        assert offline.sample_ids == online.sample_ids, rank
        for epoch in range(len(case["epochs"])):
            assert offline.batches(epoch) == online.batches(epoch), (rank, epoch)
    per_epoch = len(opened["store"]("train", reader, aux).batches(0))
    assert params["train.batches_per_epoch"] == per_epoch
    assert len(losses) == params["train.total_steps"] == sum(case["epochs"]) * per_epoch >= 2, (losses, per_epoch)

    first = {}
    for source, open_split in opened.items():  # rank 0's first step in process, as build_run sets it up
        run = build_run(cfg, build_plan(cfg, aux_layers=layers or (), vocab=vocab), target, open_split, fingerprint="")
        run.trainer.run(lambda stage, epoch: [run.train.load(run.train.batches(0)[0])],
                        on_step=lambda tr, metrics: first.setdefault(source, metrics["loss"]))
    assert first["store"] > 0 and losses[0] == pytest.approx(first["store"], abs=1e-5, rel=0), (losses[0], first)
    assert first["online"] == pytest.approx(first["store"], abs=1e-5, rel=0), first
