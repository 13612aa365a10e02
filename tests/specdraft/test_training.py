"""The training loop: loss goes down, resume mid-stage equals an uninterrupted run, acceptance counts."""

import pytest
import torch

from specdraft.acceptance import AcceptanceCounts, sim_tau, simulated_acceptance
from specdraft.batch import pad_batch
from specdraft.models import build_draft
from specdraft.configs.draft import DraftConfig
from specdraft.configs.stages import LossWeights, StageConfig
from specdraft.training import Trainer, lr_factor
from specdraft.configs.train import OptimConfig

V, D = 61, 32


def make_samples(n: int = 12, seed: int = 0):
    """A learnable toy: tokens follow a fixed permutation chain and the true state at p is
    the lm_head row of the next token, so the draft must learn t -> perm[t]."""
    g = torch.Generator().manual_seed(seed)
    table = 0.5 * torch.randn(V, D, generator=g)
    perm = torch.randperm(V, generator=g)
    out = []
    for i in range(n):
        t = 10 + i % 5
        ids = [int(torch.randint(V, (1,), generator=g))]
        for _ in range(t - 1):
            ids.append(int(perm[ids[-1]]))
        ids = torch.tensor(ids)
        out.append({"input_ids": ids, "hidden": table[perm[ids]], "loss_mask": torch.ones(t, dtype=torch.bool)})
    return out, table


def make_trainer(schedule, seed=0):
    torch.manual_seed(seed)
    samples, table = make_samples()
    cfg = DraftConfig(arch="beagle", vocab_size=V, hidden_size=D, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=16, intermediate_size=64)
    embed = torch.randn(V, D, generator=torch.Generator().manual_seed(99))  # the target's: same for every run
    draft = build_draft(cfg, embed=embed, lm_head=table.clone())
    batches = [pad_batch(samples[i : i + 4]) for i in range(0, len(samples), 4)]
    optim = OptimConfig(lr=3e-3, warmup_steps=2)
    return Trainer(draft, schedule, optim, len(batches), seed=seed), batches


SCHEDULE = [
    StageConfig(kind="early", epochs=2, window=3, noise_std=0.0, loss=LossWeights(ce=1.0, vloss=1.0)),
    StageConfig(kind="late", epochs=2, steps=3, noise_std=0.1, loss=LossWeights(ce=1.0, vloss=1.0)),
]


def test_loss_decreases_and_acceptance_rises():
    trainer, batches = make_trainer([StageConfig(kind="plain", epochs=25, noise_std=0.0)])
    before = AcceptanceCounts.zeros(3)
    for b in batches:
        before.add(simulated_acceptance(trainer.draft, b, 3))
    losses = []
    trainer.run(lambda s, e: batches, on_step=lambda tr, m: losses.append(m["loss"]))
    after = AcceptanceCounts.zeros(3)
    for b in batches:
        after.add(simulated_acceptance(trainer.draft, b, 3))
    assert sum(losses[-3:]) < 0.5 * sum(losses[:3])
    assert after.sim_tau > before.sim_tau


def test_resume_mid_stage_matches_uninterrupted_run():
    full, batches = make_trainer(SCHEDULE)
    full.run(lambda s, e: batches)

    class Stop(Exception):
        pass

    first, _ = make_trainer(SCHEDULE)
    saved = {}

    def stop_mid_late_stage(tr, metrics):
        if tr.state.stage == 1 and tr.state.epoch == 0 and tr.state.batch == 2:
            saved.update(tr.state_dict())
            raise Stop

    try:
        first.run(lambda s, e: batches, on_step=stop_mid_late_stage)
    except Stop:
        pass
    resumed, _ = make_trainer(SCHEDULE, seed=123)  # different init: everything must come from the state
    resumed.load_state_dict(saved)
    resumed.run(lambda s, e: batches)
    assert resumed.state.step == full.state.step
    for k, v in full.draft.state_dict().items():
        assert torch.equal(v, resumed.draft.state_dict()[k]), k


def test_lr_schedule_shapes():
    cfg = OptimConfig(lr=1.0, warmup_steps=10, schedule="cosine", min_lr_ratio=0.1)
    assert lr_factor(0, 110, cfg) == 0.1 and lr_factor(9, 110, cfg) == 1.0
    assert abs(lr_factor(110, 110, cfg) - 0.1) < 1e-9
    assert lr_factor(10, 110, OptimConfig(warmup_steps=10)) == 1.0


def test_sim_tau_formula_and_counts():
    assert abs(sim_tau([0.5, 0.5, 1.0]) - (0.5 + 0.25 + 0.25)) < 1e-12
    c = AcceptanceCounts(torch.tensor([3.0, 1.0]), torch.tensor([4.0, 3.0]))
    assert c.alpha == pytest.approx([0.75, 1 / 3])


def test_warmup_is_relative_to_the_run_and_capped():
    from specdraft.training import WARMUP_CAP, learning_warnings, warmup_of

    assert warmup_of(OptimConfig(), 400) == 20  # 5 % of the run
    assert warmup_of(OptimConfig(), 10**6) == WARMUP_CAP  # the papers' value is the cap
    assert warmup_of(OptimConfig(warmup_steps=7), 400) == 7  # an explicit value wins
    assert learning_warnings(OptimConfig(), 400) == []
    # the first-hour failure: 100 steps, 2000 warmup, the paper lr
    said = " ".join(learning_warnings(OptimConfig(lr=3e-5, warmup_steps=2000), 100))
    assert "never reaches its peak" in said
    said = " ".join(learning_warnings(OptimConfig(lr=1e-7), 50))
    assert "only 50 optimizer steps" in said and "tiny" in said


def test_default_schedule_learns_on_a_small_run():
    """The defaults (no lr / warmup flags) move the draft within a short run: the loss falls."""
    torch.manual_seed(0)
    samples, table = make_samples()
    cfg = DraftConfig(arch="beagle", vocab_size=V, hidden_size=D, num_attention_heads=2, num_key_value_heads=1,
                      head_dim=16, intermediate_size=64)
    embed = torch.randn(V, D, generator=torch.Generator().manual_seed(99))
    draft = build_draft(cfg, embed=embed, lm_head=table.clone())
    batches = [pad_batch(samples[i : i + 4]) for i in range(0, len(samples), 4)]
    trainer = Trainer(draft, [StageConfig(kind="plain", epochs=40, noise_std=0.0)], OptimConfig(), len(batches))
    assert trainer.warnings == [], trainer.warnings
    losses = []
    trainer.run(lambda s, e: batches, on_step=lambda tr, m: losses.append(m["loss"]))
    assert sum(losses[-3:]) < 0.5 * sum(losses[:3])
