"""The per-token feature format a draft trains on: what a target prefill gives per token, how it is
rounded as stored, and which auxiliary target layers it holds.

Per token the target's prefill gives its last hidden state (the tensor its lm_head consumes: the
feature of "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty"), the top-K logits
with the full row's log-sum-exp (the target distribution a top-K distillation loss reads, as in
"Learning Harmonized Representations for Speculative Sampling" (HASS)) and, with ``aux_layers``, the
states of auxiliary target layers (the EAGLE-3 features: "EAGLE-3: Scaling up Inference Acceleration of Large
Language Models via Training-Time Test", §3). Everything about that format lives here, once:

* ``FeaturesConfig``: what is stored and how it is computed; ``features_hash``: which of its fields
  decide the stored arrays;
* ``resolve_aux_layers`` / ``aux_layers_of``: ``"eagle3"`` or a list -> HF ``output_hidden_states``
  indices (``AUX_CONVENTION``), resolved once per consumer on its driver and passed on resolved;
* ``pad_sequences`` / ``prefill_batches``: a padded batch, and length-grouped batches under a token
  budget;
* ``prefill_features``: one padded prefill batch -> ``TokenFeatures`` of its valid tokens;
  ``sequence_features``: token sequences -> their concatenated ``TokenFeatures`` (length-grouped
  prefill batches);
* ``encode_features``: the stored arrays (the hidden codec — fp16, bf16 or int8 with a per-token
  scale —, float16 top-K logits, float32 log-sum-exp); ``decode_features``: what a reader reads back
  from them; ``nonfinite_tokens``: the tokens whose stored values are not finite;
* ``store_header``: the manifest header of a store of these features;
* ``compute_features``: per-sample feature dicts in memory (the quickstart's and the pinned tests').

The dump (Ray Data, ``pipelines/dump.py``), online features (``specdraft.online``) and the quickstart
all go through ``prefill_features`` and ``encode_features``, so a run trains on the same values
whichever way its features were made.
"""

from __future__ import annotations

import itertools
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from tqdm.auto import tqdm

from specdraft.chat import render_with_loss_mask
from specdraft.config import config_hash, to_dict
from specdraft.configs.features import EAGLE3, FeaturesConfig
from specdraft.store import ZARR_VERSION, decode_hidden, encode_hidden, plan_digest
from specdraft.targets import Target
from specdraft.targets.identity import target_fingerprint, target_id
from specdraft.targets.loading import load_target_config
from specdraft.targets.states import target_hidden, target_logits

AUX_CONVENTION = "hf_hidden_states_index: state entering decoder layer i; 0 = embeddings"
NONFINITE_CHUNK = 4096  # tokens decoded at a time when counting non-finite stored values


# not in features_hash (placement and kernel: the same features up to rounding)
RUNTIME_FIELDS = ("num_actors", "gpus_per_actor", "cpus_per_actor", "torch_threads", "attn_implementation")


def features_hash(cfg: FeaturesConfig, aux_layers: list[int] | None = None) -> str:
    """Hash of the fields that decide what is stored (resume refuses shards of another hash).

    ``aux_layers``: the resolved layer ids (``"eagle3"`` and its explicit list store the same arrays);
    without auxiliary layers the hash is that of a config predating the field."""
    fields = {k: v for k, v in to_dict(cfg).items() if k not in RUNTIME_FIELDS and k != "aux_layers"}
    if aux_layers:
        fields["aux_layers"] = list(aux_layers)
    return config_hash(fields)


# --- auxiliary layers ----------------------------------------------------------------------------


def resolve_aux_layers(aux_layers: str | list[int] | tuple[int, ...] | None, num_layers: int) -> list[int]:
    """Auxiliary target layers as HF ``output_hidden_states`` indices (i = the state entering decoder
    layer i, 0 = the embeddings), strictly increasing in ``[0, num_layers)``.

    ``None`` -> [] (no auxiliary states); ``"eagle3"`` -> the EAGLE-3 default triple, the states
    entering layers 2, N/2 and N-3 (vLLM's and SpecForge's default) — on a target too shallow for
    three distinct such layers (N < 7), the three distinct indices nearest them (``nearest_distinct``),
    with a warning naming them; a list is checked and kept.
    Index N (the final normed state) is refused: it is the stored ``hidden`` already, and serving
    engines never hand it to a draft.
    """
    if aux_layers is None:
        return []
    if isinstance(aux_layers, str):
        if aux_layers != EAGLE3:
            raise ValueError(f"aux_layers {aux_layers!r}: expected {EAGLE3!r} or a list of layer indices")
        wanted = [2, num_layers // 2, num_layers - 3]
        if 2 < num_layers // 2 < num_layers - 3:
            return wanted
        if num_layers < 3:
            raise ValueError(
                f"aux_layers={EAGLE3} needs three distinct auxiliary layers (the EAGLE-3 draft fuses three, as serving "
                f"engines expect), and a target of N={num_layers} layers has only {num_layers} states below its last "
                f"([0, {num_layers})); give an explicit shorter list instead")
        layers = nearest_distinct(wanted, num_layers)
        warnings.warn(
            f"aux_layers={EAGLE3}: the states entering layers 2, N/2 and N-3 ({wanted}) are not three distinct layers of "
            f"this N={num_layers}-layer target; using the nearest distinct ones, {layers} (HF hidden_states indices, 0 = "
            f"the embeddings; set aux_layers to a list to choose others)", stacklevel=2)
        return layers
    layers = [int(i) for i in aux_layers]
    if not layers or layers != sorted(set(layers)) or not all(0 <= i < num_layers for i in layers):
        raise ValueError(
            f"aux_layers {layers} must be strictly increasing HF hidden_states indices in [0, {num_layers}) "
            f"(i = the state entering decoder layer i, 0 = the embeddings) for this {num_layers}-layer target"
        )
    return layers


def nearest_distinct(wanted: list[int], num_layers: int) -> list[int]:
    """The ``len(wanted)`` distinct indices of ``[0, num_layers)`` nearest ``wanted`` (least total distance, ties
    to the deeper layers: the embeddings, index 0, only when nothing else is left), increasing."""
    best: tuple[int, list[int]] | None = None
    for picked in itertools.combinations(range(num_layers), len(wanted)):  # increasing tuples
        cost = sum(abs(p - w) for p, w in zip(picked, sorted(wanted)))
        if best is None or cost < best[0] or (cost == best[0] and list(picked) > best[1]):
            best = (cost, list(picked))
    assert best is not None, f"{len(wanted)} distinct layers asked of a {num_layers}-layer target"
    return best[1]


def aux_layers_of(cfg: FeaturesConfig, target_config) -> list[int]:
    """``cfg.aux_layers`` resolved for this target (HF ``output_hidden_states`` indices)."""
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    return resolve_aux_layers(cfg.aux_layers, int(text.num_hidden_layers))


# --- prefill batches -------------------------------------------------------------------------------


def pad_sequences(seqs, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids`` and ``attention_mask`` (B, T) of token sequences (arrays or lists)."""
    assert len(seqs) > 0, "pad_sequences needs at least one sequence"
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)  # (B, T)
    att = torch.zeros((len(seqs), width), dtype=torch.long)  # (B, T)
    for row, s in enumerate(seqs):
        ids[row, : len(s)] = torch.as_tensor(np.asarray(s, dtype=np.int64))  # (L,)
        att[row, : len(s)] = 1
    return ids, att


def prefill_batches(lengths: list[int], batch_tokens: int, max_batch_size: int) -> list[list[int]]:
    """Group sequence indices into padded batches by length: B * T_max <= batch_tokens."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and len(batches[-1]) < max_batch_size and lengths[batches[-1][0]] * (len(batches[-1]) + 1) <= batch_tokens:
            batches[-1].append(i)  # sorted descending: the batch's first sequence is its longest
        else:
            batches.append([i])
    return batches


# --- what a prefill gives per token ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TokenFeatures:
    """The per-token features of M tokens (sequences concatenated in order), as the prefill computed them."""

    hidden: torch.Tensor  # (M, d) in the model's dtype: the last hidden state
    topk_ids: torch.Tensor  # (M, K) int64
    topk_logits: torch.Tensor  # (M, K) float32
    logsumexp: torch.Tensor  # (M,) float32 of the full logit row
    aux_hidden: torch.Tensor  # (M, L*d) auxiliary layers' states; (M, 0) without

    def __len__(self) -> int:
        return self.hidden.shape[0]

    def cpu(self) -> TokenFeatures:
        return TokenFeatures(*(t.cpu() for t in self._parts()))

    def split(self, sizes: list[int]) -> list[TokenFeatures]:
        """Consecutive pieces of ``sizes`` tokens each (views)."""
        return [TokenFeatures(*parts) for parts in zip(*(t.split(sizes) for t in self._parts()))]

    @staticmethod
    def cat(pieces: list[TokenFeatures]) -> TokenFeatures:
        assert pieces, "TokenFeatures.cat needs at least one piece"
        return TokenFeatures(*(torch.cat(parts) for parts in zip(*(p._parts() for p in pieces))))

    @staticmethod
    def empty(d: int, topk: int, aux_width: int) -> TokenFeatures:
        """No token: zero-row arrays of the right widths."""
        return TokenFeatures(torch.zeros(0, d), torch.zeros(0, topk, dtype=torch.long), torch.zeros(0, topk),
                             torch.zeros(0), torch.zeros(0, aux_width))

    def _parts(self) -> tuple[torch.Tensor, ...]:
        return self.hidden, self.topk_ids, self.topk_logits, self.logsumexp, self.aux_hidden


@torch.no_grad()
def prefill_features(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    topk: int,
    chunk: int = 2048,
    aux_layers: list[int] | tuple[int, ...] = (),
    timings: dict[str, float] | None = None,
) -> TokenFeatures:
    """The per-token features of the valid positions of one padded prefill batch.

    ``hidden`` (M, d) in the model's dtype, ``topk_ids`` (M, K) int64, ``topk_logits`` (M, K)
    float32, ``logsumexp`` (M,) float32 of the full logit row and the auxiliary states (M, L*d) of
    ``aux_layers`` (M, 0 without), the M valid rows concatenated row by row (each sequence's tokens
    in order). The decoder runs once over the batch (``target_hidden``); the lm_head runs on the valid rows
    only, ``chunk`` rows at a time (``target_logits``), each (chunk, V) block's top-K and logsumexp taken in
    float32 — no (B, T, V) logits, none for padding. On the model's output device. ``timings``: seconds
    added under ``forward_s`` (the decoder) and ``topk_s`` (lm_head, top-K, logsumexp).
    """
    t0 = time.perf_counter()
    hidden, aux = target_hidden(model, input_ids, attention_mask, aux_layers)  # (B, T, d), (B, T, L*d) | None
    valid = attention_mask.to(hidden.device).bool()  # (B, T)
    h = hidden[valid]  # (M, d): rows concatenated in order
    aux = aux[valid] if aux is not None else h.new_zeros(h.shape[0], 0)  # (M, L*d)
    t1 = _synchronized(h, timings)
    lse, top_v, top_i = [], [], []
    for lo in range(0, h.shape[0], chunk):
        part = target_logits(model, h[lo : lo + chunk]).float()  # (m, V)
        lse.append(torch.logsumexp(part, dim=-1))  # (m,)
        top = part.topk(topk, dim=-1)
        top_v.append(top.values)  # (m, K)
        top_i.append(top.indices)  # (m, K)
    if timings is not None:
        timings["forward_s"] = timings.get("forward_s", 0.0) + t1 - t0
        timings["topk_s"] = timings.get("topk_s", 0.0) + _synchronized(h, timings) - t1
    if not lse:  # no valid position
        empty = h.new_zeros((0, topk), dtype=torch.float32)  # (0, K)
        return TokenFeatures(h, empty.long(), empty, h.new_zeros(0, dtype=torch.float32), aux)
    return TokenFeatures(h, torch.cat(top_i), torch.cat(top_v), torch.cat(lse), aux)


def _synchronized(tensor: torch.Tensor, timings: dict[str, float] | None) -> float:
    """``time.perf_counter()`` once ``tensor``'s GPU has finished its queued work (when timing at all)."""
    if timings is not None and tensor.device.type == "cuda":
        torch.cuda.synchronize(tensor.device)
    return time.perf_counter()


@torch.no_grad()
def sequence_features(
    model: torch.nn.Module,
    seqs: list[np.ndarray],
    cfg: FeaturesConfig,
    aux_layers: list[int],
    pad_id: int,
) -> tuple[TokenFeatures, dict[str, float]]:
    """``seqs``' features on the CPU (concatenated in their order), prefilled in length-grouped padded
    batches (``prefill_batches`` under ``cfg.batch_tokens``), and where the time went: ``features_s``
    (prefill + top-K + logsumexp, excluding padding and copies) split into ``forward_s`` (the decoder) and
    ``topk_s`` (lm_head, top-K, logsumexp), ``pad_s`` and ``copy_s`` (the batches' padding; the
    features' copy to the host and their concatenation), and ``padded_tokens`` (the batches' B x T)."""
    per_seq: list[TokenFeatures | None] = [None] * len(seqs)
    timings = {"forward_s": 0.0, "topk_s": 0.0, "pad_s": 0.0, "copy_s": 0.0, "padded_tokens": 0}
    for group in prefill_batches([len(s) for s in seqs], cfg.batch_tokens, cfg.max_batch_size):
        t0 = time.perf_counter()
        ids, att = pad_sequences([seqs[i] for i in group], pad_id)  # (B, T), (B, T)
        timings["pad_s"] += time.perf_counter() - t0
        timings["padded_tokens"] += ids.numel()
        features = prefill_features(model, ids, att, cfg.topk, cfg.logits_chunk, aux_layers, timings)  # lm_head's device
        t0 = time.perf_counter()
        for i, piece in zip(group, features.cpu().split([len(seqs[i]) for i in group])):
            per_seq[i] = piece
        timings["copy_s"] += time.perf_counter() - t0
    timings["features_s"] = timings["forward_s"] + timings["topk_s"]
    if not seqs:
        d = model.config.hidden_size
        return TokenFeatures.empty(d, cfg.topk, d * len(aux_layers)), timings
    t0 = time.perf_counter()
    features = TokenFeatures.cat(per_seq)
    timings["copy_s"] += time.perf_counter() - t0
    return features, timings


# --- as stored ---------------------------------------------------------------------------------------


def encode_features(features: TokenFeatures, codec: str, num_aux: int = 0) -> dict[str, np.ndarray]:
    """The stored token arrays of ``features``: ``hidden`` (+ ``hidden_scale``) in the hidden codec,
    with ``num_aux`` auxiliary layers ``aux_hidden`` in the same codec (int8: one scale per token and
    layer), ``topk_ids`` int32, ``topk_logits`` float16 and ``logsumexp`` float32."""
    out = encode_hidden(features.hidden, codec)  # (N, d) (+ (N,) scales)
    if num_aux:
        assert features.aux_hidden.shape[1] > 0, f"{num_aux} auxiliary layers asked for, none computed"
        out.update(encode_hidden(features.aux_hidden, codec, name="aux_hidden", parts=num_aux))  # (N, L*d) (+ (N, L))
    out.update(
        topk_ids=features.topk_ids.cpu().to(torch.int32).numpy(),  # (N, K)
        topk_logits=features.topk_logits.cpu().to(torch.float16).numpy(),  # (N, K)
        logsumexp=features.logsumexp.cpu().float().numpy(),  # (N,)
    )
    return out


def decode_features(arrays: dict[str, np.ndarray], codec: str) -> dict[str, torch.Tensor]:
    """Stored token arrays -> what a reader trains on: ``hidden`` (N, d) and ``aux_hidden`` (N, L*d)
    float32 (when stored), ``topk_ids`` (N, K) int64 and ``topk_logp`` = float16 logit - logsumexp
    (N, K) float32 (the store reader's ``topk_logp``)."""
    out = {"hidden": decode_hidden(arrays["hidden"], codec, arrays.get("hidden_scale"))}  # (N, d)
    if "aux_hidden" in arrays:
        out["aux_hidden"] = decode_hidden(arrays["aux_hidden"], codec, arrays.get("aux_hidden_scale"))  # (N, L*d)
    logits = torch.from_numpy(arrays["topk_logits"]).float()  # (N, K)
    out["topk_logp"] = logits - torch.from_numpy(arrays["logsumexp"]).float()[:, None]  # (N, K)
    out["topk_ids"] = torch.from_numpy(arrays["topk_ids"]).long()  # (N, K)
    return out


def nonfinite_tokens(arrays: dict[str, np.ndarray], codec: str) -> int:
    """Tokens whose stored top-K logits, hidden or auxiliary states a reader decodes to a non-finite
    value (a float16 overflow included)."""
    finite = torch.isfinite(torch.from_numpy(arrays["topk_logits"])).all(-1)  # (N,)
    for lo in range(0, len(finite), NONFINITE_CHUNK):
        hi = lo + NONFINITE_CHUNK
        for name in ("hidden", "aux_hidden"):
            if name in arrays:
                scale = arrays[f"{name}_scale"][lo:hi] if f"{name}_scale" in arrays else None
                stored = decode_hidden(arrays[name][lo:hi], codec, scale)  # (n, d) | (n, L*d)
                finite[lo:hi] &= torch.isfinite(stored).all(-1)
    return int((~finite).sum())


def store_header(target: Target | str | Path, cfg: FeaturesConfig, plan: list[dict[str, Any]], num_rows: int,
                 duplicates: int) -> dict[str, Any]:
    """Everything in a dumped store's manifest besides the shard records: target, features, plan.

    ``aux_layers`` is resolved here, once for the whole dump; the prefill workers get the resolved list."""
    target = Target.of(target)
    tconf = load_target_config(target, trust_remote_code=cfg.trust_remote_code)
    aux_layers = aux_layers_of(cfg, tconf)
    return {
        "target_id": target_id(target),
        "target_fingerprint": target_fingerprint(target),  # checked by every consumer (store.manifest.check_store_target)
        "target_path": str(target.path),
        "target_config_hash": config_hash(tconf.to_dict()),
        "model_type": tconf.model_type,
        "vocab_size": tconf.vocab_size,
        "d": int(tconf.hidden_size),
        "k": cfg.topk,
        "hidden_codec": cfg.hidden_codec,
        "aux_layers": aux_layers,  # HF output_hidden_states indices of aux_hidden's L slices ([]: none stored)
        "aux_convention": AUX_CONVENTION,
        "features": to_dict(cfg),
        "features_hash": features_hash(cfg, aux_layers),
        "samples_per_shard": cfg.samples_per_shard,
        "num_shards": len(plan),
        "input": {"rows": num_rows, "duplicate_ids": duplicates,
                  "plan_digest": plan_digest(plan)},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "zarr": ZARR_VERSION},
    }


# --- in memory -----------------------------------------------------------------------------------------


@torch.no_grad()
def compute_features(model, tokenizer, conversations, max_length: int, topk: int, batch_size: int = 32, progress=True,
                     aux_layers: list[int] | tuple[int, ...] = ()):
    """Per-sample feature dicts computed in memory, in length-sorted batches of ``batch_size``:
    ``prefill_features`` with the hidden (and, with ``aux_layers``, ``aux_hidden`` (T, L*d), the EAGLE-3
    features, from the same forward) as an fp16 store holds them, and the top-K log-probs
    ``topk_logits - logsumexp`` in float32 (not rounded through float16: nothing is stored)."""
    rendered = [render_with_loss_mask(tokenizer, conv, max_length=max_length) for conv in conversations]
    samples = []
    order = sorted(range(len(rendered)), key=lambda i: len(rendered[i].input_ids))
    bar = tqdm(total=len(order), desc="features", disable=not progress, leave=False)
    for start in range(0, len(order), batch_size):
        chunk = [rendered[i] for i in order[start : start + batch_size]]
        ids, att = pad_sequences([r.input_ids for r in chunk], tokenizer.pad_token_id or 0)  # (B, T), (B, T)
        features = prefill_features(model, ids, att, topk, aux_layers=aux_layers).cpu()
        stored = encode_features(features, "fp16", len(aux_layers))
        topk_logp = features.topk_logits - features.logsumexp[:, None]  # (M, K)
        lo = 0
        for r in chunk:
            hi = lo + len(r.input_ids)
            samples.append(
                {
                    "input_ids": torch.tensor(r.input_ids, dtype=torch.int64),  # (T,)
                    "hidden": torch.from_numpy(stored["hidden"][lo:hi]),  # (T, d) float16
                    "loss_mask": torch.tensor(r.loss_mask, dtype=torch.bool),  # (T,)
                    "topk_ids": features.topk_ids[lo:hi],  # (T, K)
                    "topk_logp": topk_logp[lo:hi],  # (T, K)
                    **({"aux_hidden": torch.from_numpy(stored["aux_hidden"][lo:hi])} if aux_layers else {}),  # (T, L*d)
                }
            )
            lo = hi
        bar.update(len(chunk))
    bar.close()
    return samples


def sample_arrays(samples: list[dict[str, torch.Tensor]], sample_ids: list[str]) -> dict[str, np.ndarray]:
    """One shard's arrays (``store.write_shard``) of ``compute_features`` samples: the sequences concatenated,
    fp16 hidden (and ``aux_hidden`` when the samples have it), top-K log-probs as ``topk_logits`` with a zero
    ``logsumexp`` (they are normalised already), offsets and ``sample_ids``."""
    assert len(samples) == len(sample_ids), f"{len(samples)} samples but {len(sample_ids)} ids"
    lengths = [s["input_ids"].shape[0] for s in samples]
    arrays = {
        "input_ids": torch.cat([s["input_ids"] for s in samples]).numpy().astype(np.int32),  # (N,)
        "loss_mask": torch.cat([s["loss_mask"] for s in samples]).numpy().astype(np.uint8),  # (N,)
        "hidden": torch.cat([s["hidden"] for s in samples]).numpy(),  # (N, d)
        "topk_ids": torch.cat([s["topk_ids"] for s in samples]).numpy().astype(np.int32),  # (N, K)
        "topk_logits": torch.cat([s["topk_logp"] for s in samples]).numpy().astype(np.float16),  # (N, K)
        "logsumexp": np.zeros(sum(lengths), np.float32),  # (N,)
        "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),  # (S+1,)
        "sample_ids": np.array(sample_ids),  # (S,)
    }
    if "aux_hidden" in samples[0]:
        arrays["aux_hidden"] = torch.cat([s["aux_hidden"] for s in samples]).numpy()  # (N, L*d)
    return arrays
