"""``check_export``: re-read an exported directory and refuse what an engine would silently misread.

Each known export failure of the anchors (docs/serving.md) has its own check and message:
missing ``d2t`` (vLLM then maps draft id i to target id i), ``d2t`` written as absolute ids
instead of offsets, a ``t2d`` that disagrees with it, auxiliary-layer ids off by one for the
engine's convention (vLLM: the state entering layer i; SGLang: the output of layer k), an
``embed_tokens`` the engine would use instead of the target's (or none where one is needed),
a ``max_position_embeddings`` below the target's (the engine caps the context), tensors not
in the target's / the requested dtype — plus the names, shapes and flags each engine reads
(it leaves an unmatched parameter at its random init or drops an unknown tensor unnoticed).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from specdraft.export.llama import expected_shapes
from specdraft.export.spec import VLLM_FORMATS, ExportError, ExportSpec
from specdraft.placement import dtype_name, resolve_dtype

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def _get(config: dict[str, Any], path: str) -> Any:
    node: Any = config
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def _aux_problems(config: dict[str, Any], spec: ExportSpec) -> list[str]:
    problems = []
    aux = list(spec.draft.aux_layers)
    for path, offset in spec.layout.aux_ids:
        want = [i + offset for i in aux]
        got = _get(config, path)
        meaning = "the output of layer k (SGLang)" if offset == -1 else "the state entering layer i (vLLM)"
        if got is None:
            problems.append(f"{path} is missing: the engine would capture its default layers (2, N/2, N-3) "
                            f"instead of the draft's hidden_states {aux} (expected {want}, ids meaning {meaning})")
        elif list(got) != want:
            off = {int(g) - w for g, w in zip(got, want)} if len(got) == len(want) else set()
            why = f"off by one ({sorted(off)[0]:+d})" if off in ({1}, {-1}) else "wrong"
            problems.append(f"{path} = {list(got)} is {why}: ids here mean {meaning}, and the draft reads HF "
                            f"hidden_states {aux}, so they must be {want}")
    return problems


def _vocab_problems(tensors: dict[str, torch.Tensor], spec: ExportSpec) -> list[str]:
    c = spec.draft
    if not spec.vocab_maps:
        present = sorted({"d2t", "t2d"} & set(tensors))
        return [f"{present} present for a draft vocabulary that is the whole target vocabulary: vLLM builds its "
                "draft-to-target id map only for a smaller vocabulary and refuses to load these tensors "
                "(\"no module or parameter named 'draft_id_to_target_id'\")"] if present else []
    if "d2t" not in tensors:
        return ["d2t is missing: vLLM then maps draft id i to target id i (an identity it initialises to zero "
                "offsets) and SGLang has no hot-token map, so every draft token beyond the shared prefix of the "
                "vocabularies is a different token"]
    d2t, t2d = tensors["d2t"].long(), tensors.get("t2d")
    if t2d is None:
        return ["t2d is missing (speculators reads it to know which target ids the draft can emit)"]
    ids = torch.arange(d2t.numel()) + d2t  # what the engines compute: target = draft id + d2t[draft id]
    consistent = (bool((ids >= 0).all()) and bool((ids < c.vocab_size).all()) and bool((ids[1:] > ids[:-1]).all())
                  and bool(t2d[ids.clamp(0, c.vocab_size - 1)].all()) and int(t2d.sum()) == d2t.numel())
    if consistent:
        return []
    absolute = (bool((d2t >= 0).all()) and bool((d2t < c.vocab_size).all()) and bool((d2t[1:] > d2t[:-1]).all())
                and bool(t2d[d2t.clamp(0, c.vocab_size - 1)].all()))
    if absolute:
        return ["d2t holds absolute target ids, not offsets: the engines compute target id = draft id + d2t[draft "
                "id], so every draft token would map to the wrong target token (write d2t = ids - arange)"]
    return [f"d2t and t2d disagree: draft id + d2t gives target ids that are not the {int(t2d.sum())} ids t2d marks "
            f"(or leave [0, {c.vocab_size}) or are not increasing)"]


def _block_problems(config: dict[str, Any], layer: dict[str, Any], spec: ExportSpec) -> list[str]:
    """What vLLM's speculators ``dflash`` reader (``update_dflash``, ``DFlashQwen3ForCausalLM``) would misread."""
    c, problems = spec.draft, []
    for key, want in (("mask_token_id", c.mask_token_id), ("block_size", c.block_size),
                      ("draft_vocab_size", c.output_vocab_size),
                      ("target_hidden_size", c.target_hidden_size or c.hidden_size)):
        if config.get(key) != want:
            problems.append(f"{key} = {config.get(key)!r}, the draft has {want!r}")
    if config.get("sliding_window_non_causal", True) is not True:
        problems.append("sliding_window_non_causal is false: vLLM then builds the draft's attention CAUSAL "
                        "(dflash_config.causal = not this flag), while a DFlash block attends bidirectionally")
    if layer.get("model_type") not in ("qwen3", "llama") or layer.get("hidden_act") != "silu":
        problems.append(f"transformer_layer_config model_type {layer.get('model_type')!r} / hidden_act "
                        f"{layer.get('hidden_act')!r}: vLLM builds Qwen3 layers with a SiLU MLP")
    theta = (layer.get("rope_parameters") or {}).get("rope_theta")
    if theta != c.rope_parameters.get("rope_theta"):
        problems.append(f"rope_parameters.rope_theta = {theta!r}, the draft's is {c.rope_parameters.get('rope_theta')!r} "
                        "(vLLM's DFlash layer falls back to 1e6 when it is missing)")
    if layer.get("attention_bias") or layer.get("layer_types") or layer.get("is_causal"):
        problems.append("attention_bias / layer_types / is_causal set: vLLM would add biases, sliding windows or a "
                        "causal mask the draft does not have")
    return problems + _aux_problems(config, spec)


def _config_problems(config: dict[str, Any], layer: dict[str, Any], spec: ExportSpec) -> list[str]:
    """What the engine would misread in ``config.json`` (``layer``: the part holding the layer's geometry)."""
    layout, problems = spec.layout, []
    if config.get("architectures") != list(layout.architectures):
        problems.append(f"architectures {config.get('architectures')} should be {list(layout.architectures)} "
                        f"(it picks the engine's model class)")
    c, t = spec.draft, spec.target
    geometry = {"vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
                "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
                "num_hidden_layers": c.num_layers, "tie_word_embeddings": False}
    if spec.format != "eagle":  # the reference derives head_dim from hidden_size / heads
        geometry["head_dim"] = c.head_dim
    for key, want in geometry.items():
        if layer.get(key) != want:
            problems.append(f"{key} = {layer.get(key)!r}, the draft has {want!r}")
    max_pos = layer.get("max_position_embeddings")
    if not isinstance(max_pos, int) or max_pos < t.max_position_embeddings:
        problems.append(f"max_position_embeddings = {max_pos!r} is below the target's {t.max_position_embeddings}: "
                        "the engine caps the served context at the draft's value")
    if layer.get("torch_dtype") != spec.dtype:
        problems.append(f"torch_dtype = {layer.get('torch_dtype')!r}, expected {spec.dtype!r}")
    if spec.format == "eagle":
        if config.get("bias") is not True:
            problems.append(f"bias = {config.get('bias')!r}: the EAGLE reference then builds fc without its bias and "
                            "drops fc.bias (load_state_dict(strict=False))")
    elif "bias" in config:
        problems.append("a top-level 'bias' key: vLLM and SGLang read it as the attention bias of the layer")
    if spec.format in VLLM_FORMATS and config.get("architectures") in (["LlamaForCausalLM"], ["EagleLlamaForCausalLM"]) \
            and c.arch == "eagle":
        problems.append("vLLM's own EagleLlamaForCausalLM builds fc without a bias and drops the checkpoint's fc.bias "
                        "with only a DEBUG line: the draft's logits would not be reproduced (export format 'vllm' "
                        "writes specdraft's plugin architecture, which keeps it)")
    if spec.format == "speculators" and layer.get("model_type") not in ("llama", "qwen3"):
        problems.append(f"transformer_layer_config.model_type = {layer.get('model_type')!r}: vLLM's speculators "
                        "converter builds only 'llama' or 'qwen3' draft layers")
    if layout.plugin:
        from specdraft.serving.vllm_plugin import ARCHITECTURES

        unknown = [a for a in config.get("architectures") or [] if a not in ARCHITECTURES]
        if unknown:
            problems.append(f"architectures {unknown} are not registered by specdraft's vLLM plugin "
                            f"({sorted(ARCHITECTURES)}): vLLM would refuse the draft")
    if c.aux_layers and not c.drafts_blocks:  # a block draft's fields: ``_block_problems``
        for key, want in (("draft_vocab_size", c.draft_vocab_size),
                          ("target_hidden_size", c.target_hidden_size or c.hidden_size),
                          ("norm_before_residual", c.norm_before_residual)):
            if key == "norm_before_residual" and c.arch != "eagle3":
                continue
            if config.get(key) != want:
                problems.append(f"{key} = {config.get(key)!r}, the draft has {want!r}"
                                + (" (vLLM defaults it to True when absent)" if key == "norm_before_residual" else ""))
        problems += _aux_problems(config, spec)
    if c.drafts_blocks:
        problems += _block_problems(config, layer, spec)
    if spec.format == "speculators":
        spec_cfg = config.get("speculators_config") or {}
        proposals = spec_cfg.get("proposal_methods") or [{}]
        algorithm = "dflash" if c.drafts_blocks else "eagle3"
        if config.get("speculators_model_type") != algorithm or spec_cfg.get("algorithm") != algorithm:
            problems.append(f"speculators_model_type / speculators_config.algorithm must be {algorithm!r}")
        if proposals[0].get("speculative_tokens") != spec.speculative_tokens:
            problems.append(f"speculative_tokens = {proposals[0].get('speculative_tokens')!r}, "
                            f"expected {spec.speculative_tokens}")
        if not (spec_cfg.get("verifier") or {}).get("name_or_path"):
            problems.append("speculators_config.verifier.name_or_path is empty: `vllm serve DIR` cannot find the target")
    return problems


def _tensor_problems(tensors: dict[str, torch.Tensor], spec: ExportSpec) -> list[str]:
    """What the engine would misread in ``model.safetensors``: names, shapes, dtypes, the embedding, the
    vocabulary maps."""
    layout, c, problems = spec.layout, spec.draft, []
    want_shapes = expected_shapes(spec, layout.layer_prefix)
    embeds = sorted(k for k in tensors if "embed" in k)
    if embeds and not layout.embedding:
        problems.append(f"{embeds} present: the engines would use this copy instead of the target's embedding "
                        "(vLLM's has_own_embed_tokens); a stale or random one silently ruins acceptance")
    if layout.embedding and "embed_tokens.weight" not in tensors:
        problems.append("embed_tokens.weight is missing: this format reads the draft's own embedding, which the "
                        "engine would leave at its random init")
    missing = sorted(set(want_shapes) - set(tensors) - {"d2t", "t2d"})
    if missing:
        problems.append(f"missing tensors {missing}: the engine leaves those parameters at their random init")
    if layout.embedding:
        want_shapes["embed_tokens.weight"] = (c.vocab_size, c.hidden_size)
    unknown = sorted(set(tensors) - set(want_shapes) - set(embeds))
    if unknown:
        problems.append(f"unexpected tensors {unknown}: the engine drops names it does not know without a word")
    for name, tensor in tensors.items():
        shape = want_shapes.get(name)
        if shape is not None and tuple(tensor.shape) != shape:
            problems.append(f"{name} has shape {tuple(tensor.shape)}, expected {shape}")
        want_dtype = {"d2t": torch.int64, "t2d": torch.bool}.get(name)
        if want_dtype is not None and tensor.dtype != want_dtype:
            problems.append(f"{name} is {tensor.dtype}, the engines read {want_dtype}")
        if want_dtype is None and tensor.dtype != resolve_dtype(spec.dtype, torch.device("cpu")):
            problems.append(f"{name} is {dtype_name(tensor.dtype)}, not the requested/target dtype "
                            f"{spec.dtype}")
    if c.own_vocab:
        problems += _vocab_problems(tensors, spec)
    return problems


def check_export(out_dir: str | Path, spec: ExportSpec, reference: dict[str, torch.Tensor] | None = None) -> None:
    """Raise ``ExportError`` listing every problem of the exported directory ``out_dir`` for ``spec``.

    ``reference``: the tensors the export must hold by engine name (the exporter passes the draft's own,
    cast), compared exactly.
    """
    out = Path(out_dir)
    problems: list[str] = []
    for name in ("config.json", "model.safetensors"):
        if not (out / name).is_file():
            raise ExportError(f"{out}: {name} is missing")
    stray = sorted(p.name for p in out.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.name != "model.safetensors")
    if stray:
        problems.append(f"other weight files {stray}: an engine may load them instead of model.safetensors")
    config = json.loads((out / "config.json").read_text())
    layer = config.get(spec.layout.layer_config, {}) if spec.layout.layer_config else config
    problems += _config_problems(config, layer, spec)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    problems += _tensor_problems(tensors, spec)
    if reference is not None and not problems:
        differ = sorted(k for k, v in reference.items() if k in tensors and not torch.equal(tensors[k], v))
        if differ:
            problems.append(f"tensors {differ} differ from the draft's")
    if problems:
        raise ExportError(f"{out} ({spec.format}, {spec.draft.arch} draft): " + "; ".join(problems))
