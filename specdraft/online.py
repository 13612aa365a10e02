"""Online features: the target computes each training batch's features on the fly (no store).

SpecForge's online mode (the SpecForge paper, §3 "Sub-optimal Prefill Performance", §4.1): the
trainer runs the target's prefill on every batch instead of reading the features a dump stored. For users who cannot store them (2d + 6K + 5 bytes per token), at the cost
of one target forward per batch and the target's weights in every training worker's memory.

Online and offline training see the same batches and the same values:

* ``chat.tokenize_conversations``: the dump's rows in the dump's order (unique ids, sorted — the shard
  plan of ``store.plan_shards``), each through ``chat.tokenize_conversation`` (the dump's chat
  template, loss mask, ``max_length`` and ``overlong`` rule), rejected rows left out;
* ``OnlineDataset``: ``FeatureDataset``'s interface (``cfg``, ``batches``, ``load``) and its batch
  planner (``store.plan_batches``: length buckets, seeded order, ``balance_batches`` across ranks;
  held-out split by sample-id hash); ``load`` runs ``features.prefill_features`` (the dump's forward,
  top-K and float32 logsumexp, and with ``aux_layers`` the auxiliary layers' states of the same
  forward: the EAGLE-3 features) and rounds the values through ``features.encode_features`` and
  ``features.decode_features`` exactly as the dump stores them and the reader reads them back, then
  pads with ``batch.pad_batch`` like the store reader;
* ``TokenizedConversations.predicted_token_counts``: the draft-vocabulary statistics
  (``vocab.count_predicted_tokens``) of these tokens, as ``store.predicted_token_counts`` counts a
  store of them.

The one difference is the forward's batch shape (the dump prefills its own length groups, online
the training batch): the same tokens in another padded batch can differ in the last float bits,
which the float16 rounding almost always absorbs.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

from specdraft.batch import Batch, pad_batch
from specdraft.chat import TokenizedConversations
from specdraft.features import decode_features, encode_features, pad_sequences, prefill_features
from specdraft.store import HIDDEN_CODECS, is_held_out, plan_batches
from specdraft.configs.reader import ReaderConfig


class OnlineDataset:
    """Batches of target features computed on the fly, for one (rank, world_size) partition and one split.

    ``model`` is the frozen target (``target.load_target_model``); its forward runs on the model's
    device under ``no_grad`` in the model's dtype; the returned ``Batch`` is on the CPU, as the store
    reader's. ``hidden_codec`` (``fp16`` | ``bf16`` | ``int8``) is the store codec whose rounding the
    hidden states go through, so a run trains on the values its dump would have stored.
    ``aux_layers``: the resolved auxiliary layers (HF ``output_hidden_states`` indices, as a dump's
    manifest records them; the run plan's); every batch carries their states as ``aux_hidden``
    (B, T, L*d), as the store reader fills it from a store dumped with them.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        data: TokenizedConversations,
        cfg: ReaderConfig = ReaderConfig(),
        *,
        topk: int,
        hidden_codec: str = "fp16",
        logits_chunk: int = 2048,
        split: Literal["train", "val", "all"] = "train",
        rank: int = 0,
        world_size: int = 1,
        aux_layers: list[int] | tuple[int, ...] = (),
    ) -> None:
        assert split in ("train", "val", "all"), f"split {split!r} not in train/val/all"
        assert 0 <= rank < world_size, f"rank {rank} not in [0, {world_size})"
        assert hidden_codec in HIDDEN_CODECS, f"hidden codec {hidden_codec!r} not in {HIDDEN_CODECS}"
        assert topk >= 1 and logits_chunk >= 1, "topk and logits_chunk must be >= 1"
        self.model, self.data, self.cfg = model, data, cfg
        self.topk, self.hidden_codec, self.logits_chunk = topk, hidden_codec, logits_chunk
        self.split, self.rank, self.world_size, self.epoch = split, rank, world_size, 0
        self.aux_layers: list[int] = [int(i) for i in aux_layers]  # the run plan's, as FeatureDataset's
        self.pad_id = model.config.pad_token_id or 0  # as the dump pads (padding is masked out anyway)
        keep = [split == "all" or is_held_out(s, cfg.val_fraction) == (split == "val") for s in data.sample_ids]
        self._index = np.flatnonzero(np.asarray(keep, bool)).astype(np.int64)  # (S,) rows of ``data`` in this split
        self.sample_ids = [data.sample_ids[i] for i in self._index.tolist()]
        self._full_length = np.asarray([len(data.input_ids[i]) for i in self._index.tolist()], np.int64)  # (S,)

    @property
    def _length(self) -> np.ndarray:
        """Sequence lengths after the reader's ``max_length`` (read by the shared batch planner)."""
        if self.cfg.max_length is None:
            return self._full_length  # (S,)
        return np.minimum(self._full_length, self.cfg.max_length)  # (S,)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def global_batches(self, epoch: int | None = None) -> list[list[int]]:
        """All batches (sequence indices) of the split for ``epoch``: the store reader's own planner, run
        on these lengths, so a store of the same conversations gives the same batches in the same order."""
        return plan_batches(self._length, self.cfg, self.epoch if epoch is None else epoch, self.world_size)

    def batches(self, epoch: int | None = None) -> list[list[int]]:
        """This rank's batches for ``epoch``."""
        return self.global_batches(epoch)[self.rank :: self.world_size]

    def __len__(self) -> int:
        return len(self.batches())

    def epoch_batches(self, epoch: int) -> "OnlineEpoch":
        """This rank's batches of ``epoch`` as a lazy sequence (the store reader's interface): each is
        computed when it is asked for, on the training thread — the target runs on the worker's device."""
        return OnlineEpoch(self, self.batches(epoch))

    def load(self, seqs: list[int], lazy: bool = False) -> Batch:
        """One target forward over sequences ``seqs`` (indices into this split) -> a right-padded ``Batch``.

        ``lazy`` is accepted for the store reader's interface; online features come out decoded."""
        lengths = self._length[seqs].tolist()
        rows = [int(self._index[i]) for i in seqs]
        tokens = [self.data.input_ids[r][:n] for r, n in zip(rows, lengths)]
        ids, att = pad_sequences(tokens, self.pad_id)  # (B, T), (B, T)
        # the M valid positions, row by row, as the dump stores them and the reader reads them back
        features = prefill_features(self.model, ids, att, self.topk, self.logits_chunk, self.aux_layers)
        stored = decode_features(encode_features(features, self.hidden_codec, len(self.aux_layers)), self.hidden_codec)
        hidden, topk_ids, topk_logp = stored["hidden"], stored["topk_ids"], stored["topk_logp"]  # (M, d), (M, K), (M, K)
        aux = stored.get("aux_hidden")  # (M, L*d) | None
        samples, lo = [], 0
        for r, n, seq in zip(rows, lengths, tokens):
            samples.append({
                "input_ids": torch.as_tensor(seq, dtype=torch.int64),  # (L,)
                "hidden": hidden[lo : lo + n],  # (L, d)
                "loss_mask": torch.as_tensor(self.data.loss_mask[r][:n], dtype=torch.bool),  # (L,)
                "topk_ids": topk_ids[lo : lo + n],  # (L, K)
                "topk_logp": topk_logp[lo : lo + n],  # (L, K)
                **({"aux_hidden": aux[lo : lo + n]} if self.aux_layers else {}),  # (L, A*d), A aux layers
            })
            lo += n
        assert lo == hidden.shape[0], f"{hidden.shape[0]} feature rows for {lo} tokens"
        return pad_batch(samples)


class OnlineEpoch:
    """One epoch's batches of one rank, each computed by ``OnlineDataset.load`` when indexed (any order)."""

    def __init__(self, dataset: OnlineDataset, plan: list[list[int]]) -> None:
        self.dataset, self.plan = dataset, plan

    def __len__(self) -> int:
        return len(self.plan)

    def __getitem__(self, i: int) -> Batch:
        assert 0 <= i < len(self.plan), f"batch {i} outside [0, {len(self.plan)})"
        return self.dataset.load(self.plan[i])
