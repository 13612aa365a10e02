"""Gradient sync and sharding inside real Ray Train workers (gloo), on tiny drafts without a target: DDP's
all-reduce on the last sub-step of an accumulation group only, FSDP2's sharding, clipping and full state dict, a
DFlash block draft under FSDP2 (split from tests/pipelines/test_train.py: one file is one unit of scheduling under
``--dist loadfile``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from specdraft.batch import Batch
from specdraft.configs.draft import DraftConfig
from specdraft.configs.stages import LossWeights, StageConfig
from specdraft.models import build_draft

pytestmark = pytest.mark.slow

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
