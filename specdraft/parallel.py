"""Data parallelism for a draft: replicated (DDP) or sharded (FSDP2), applied from outside the model.

Model code knows no distribution: ``distribute`` wraps a built draft for the worker group the caller
has already joined (``torch.distributed`` initialised by whoever launched the workers: Ray Train,
torchrun), with plain torch — ``torch.nn.parallel.DistributedDataParallel`` ("PyTorch Distributed:
Experiences on Accelerating Data Parallel Training", §3-4: gradient buckets all-reduced during the
backward, skipped under ``no_sync``) or ``torch.distributed.fsdp.fully_shard`` ("PyTorch FSDP:
Experiences on Scaling Fully Sharded Data Parallel", §3: parameters sharded over the ranks, gathered
for the forward and backward, gradients reduce-scattered). Each returns the wrapped model and its
gradient-sync switch (``Trainer.grad_sync``); ``gathered`` gathers FSDP2 weights for code that runs
outside a forward (validation drafting).
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager, nullcontext

import torch

from specdraft.models.heads import FROZEN
from specdraft.objectives import GradSync, no_grad_sync_needed


def distribute(draft, strategy: str, world: int, device) -> tuple[torch.nn.Module, GradSync]:
    """The draft wrapped for ``world`` workers, and its gradient-sync switch (``Trainer.grad_sync``).

    Choosing (``train.scaling.strategy``): ``ddp`` replicates the draft — every rank holds its fp32
    weights, gradients and AdamW state (16 bytes per trainable parameter) and gradients are
    all-reduced; ``fsdp`` shards those over the N ranks (``shard_draft``: each holds 1/N) at the
    cost of gathering the weights for every sub-step. A draft is one layer: 0.22-0.43 B parameters
    at Llama-3-8B's shape (3.3-6.3 GiB of weights + gradients + AdamW state; the top is EAGLE-3
    with a 32k draft vocabulary), 0.86-1.4 B at Llama-3-70B's (13-21 GiB). DDP is the default;
    FSDP pays off when that state crowds out activations (large targets, long sequences, ``ttt``).

    DDP: the draft is moved to ``device`` (on CUDA, made the current device and DDP's only device,
    as ``ray.train.torch.prepare_model`` did); the frozen target tensors are buffers every rank loads
    from the target itself, so they are neither broadcast at construction nor before each forward
    (ignored, and not synchronised before a forward: a 128k x 4096 embedding is 1 GB), and gradients are
    synchronised only on the last backward of an accumulation group (``no_sync`` elsewhere).
    """
    assert strategy in ("ddp", "fsdp"), f"unknown train.scaling.strategy {strategy!r}: ddp or fsdp"
    if world == 1:
        return draft.to(device), no_grad_sync_needed
    if strategy == "fsdp":
        return shard_draft(draft.to(device), world, device)
    from torch.nn.parallel import DistributedDataParallel

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    frozen = [f"heads.{name}" for name, _ in draft.heads.named_buffers() if name in FROZEN]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(draft, frozen)
    placement = {"device_ids": [device], "output_device": device} if device.type != "cpu" else {}
    # buffers are not synchronised before each forward: ``forward_sync_buffers`` where torch has it (2.13 deprecates
    # ``broadcast_buffers`` with a FutureWarning on every rank), ``broadcast_buffers`` before (torch 2.11 on GPUs)
    sync = ("forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
            else "broadcast_buffers")
    model = DistributedDataParallel(draft.to(device), **{sync: False}, **placement)
    return model, lambda enabled: nullcontext() if enabled else model.no_sync()


def shard_draft(draft, world: int, device) -> tuple[torch.nn.Module, GradSync]:
    """The draft sharded with FSDP2 (``fully_shard``, in place) over ``world`` ranks, and its
    gradient-sync switch.

    * Frozen tensors: the target's embedding, shared lm_head and teacher rows are non-persistent
      buffers of ``draft.heads``. FSDP shards, gathers and reduces parameters only, so every rank
      keeps the full copy it loaded from the target and they are never communicated.
    * The body is one unit, the root: a draft is one layer, so more units would only add
      all-gathers. The root keeps its weights gathered from its forward to its backward
      (``reshard_after_forward=False``), so a chained stage's several forwards before one backward
      (``ttt``) gather once. When ``ttt``'s backward reaches a forward whose inputs carry gradient
      (the fed-back states), FSDP reshards the root there and gathers it again for the earlier
      forward's backward: correct, one extra all-gather per step.
    * The head of a draft with its own vocabulary (EAGLE-3: trainable ``heads.norm`` +
      ``heads.lm_head``) is used by the losses *outside* the draft's forward (``objectives.score`` ->
      ``losses.head_loss``), where FSDP's hooks do not reach, so it is a second unit: a forward hook
      on the draft gathers it at the end of every forward (the losses run right after), and FSDP's
      end-of-backward callback, which visits every unit, reduce-scatters its gradients and
      reshards it once the whole backward is done. Inside the root unit it would be resharded with
      the root in the middle of ``ttt``'s backward, while earlier steps' head backwards still read
      it (freed storage: a crash).
    * Gradient sync: ``set_requires_gradient_sync(enabled)`` on every unit. Off, FSDP accumulates
      unsharded gradients locally; the last backward of an accumulation group reduce-scatters the
      sum (averaged over ranks, as DDP does).
    * Outside a forward (validation) the weights are gathered by ``gathered``; checkpoints gather
      the full state with every rank taking part (``Trainer.state_dict``).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(torch.device(device).type, (world,))
    heads = draft.heads
    if any(True for _ in heads.parameters()):
        fully_shard(heads, mesh=mesh)
        draft.register_forward_hook(lambda module, args, output: heads.unshard())
    fully_shard(draft, mesh=mesh, reshard_after_forward=False)

    @contextmanager
    def grad_sync(enabled: bool):
        draft.set_requires_gradient_sync(enabled)  # recursive: both units
        try:
            yield
        finally:
            draft.set_requires_gradient_sync(True)

    return draft, grad_sync


@contextmanager
def gathered(model):
    """``model`` with every FSDP2 unit's weights gathered, for code that runs outside its forward
    (validation drafting); collective: every rank enters it. A plain or DDP model is left as it is."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.unshard()
    try:
        yield model
    finally:
        for unit in units:
            unit.reshard()
