"""The Llama vocabulary every format shares: one decoder layer's config dict and tensor names.

All engines build an EAGLE draft as one Llama decoder layer: EAGLE-1/2 as
``fc`` over cat(embed, feature) then layer 0 without ``input_layernorm`` (vLLM
``EagleLlamaForCausalLM``, SGLang ``LlamaForCausalLMEagle``, the EAGLE reference ``cnets1``);
EAGLE-3 as ``fc`` over three auxiliary states, a layer whose q/k/v read
cat(input_layernorm(embed), hidden_norm(feature)), a final ``norm`` and its own ``lm_head``
with ``d2t``/``t2d`` (vLLM ``Eagle3LlamaForCausalLM`` names the layer ``layers.0.``, SGLang
``LlamaForCausalLMEagle3`` ``midlayer.``). This module maps specdraft's parameter names onto
those and writes the layer's HF ``LlamaConfig`` fields from the draft and its target.

A block draft ("DFlash: Block Diffusion for Flash Speculative Decoding" §3; vLLM ``DFlashQwen3ForCausalLM``)
has several Qwen3 layers (q/k norms per head) and already uses the engine's names: ``layers.i.self_attn.*``,
``layers.i.mlp.*``, top-level ``fc``, ``hidden_norm`` and ``norm`` (layer prefix "").
"""

from __future__ import annotations

from typing import Any

import torch

from specdraft.export.spec import ExportSpec

LAYER = {  # specdraft name -> name inside the engine's decoder layer
    "q_proj.weight": "self_attn.q_proj.weight",
    "k_proj.weight": "self_attn.k_proj.weight",
    "v_proj.weight": "self_attn.v_proj.weight",
    "o_proj.weight": "self_attn.o_proj.weight",
    "mlp.gate_proj.weight": "mlp.gate_proj.weight",
    "mlp.up_proj.weight": "mlp.up_proj.weight",
    "mlp.down_proj.weight": "mlp.down_proj.weight",
    "post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "input_layernorm.weight": "input_layernorm.weight",  # EAGLE-3: the embedding's norm
    "hidden_norm.weight": "hidden_norm.weight",  # EAGLE-3: the feature's norm
    "norm_query.weight": "query_norm.weight",  # Beagle: the token embedding's norm (queries)
    "norm_state.weight": "state_norm.weight",  # Beagle: the states' norm (keys/values)
    "norm_mlp.weight": "post_attention_layernorm.weight",  # Beagle: the MLP's input norm
}
TOP = {  # specdraft name -> top-level engine name
    "fc.weight": "fc.weight",
    "fc.bias": "fc.bias",  # EAGLE-1/2 (the reference's fc has a bias)
    "heads.norm.weight": "norm.weight",
    "heads.lm_head.weight": "lm_head.weight",
    "heads.d2t": "d2t",
    "heads.t2d": "t2d",
}


def engine_tensors(
    state: dict[str, torch.Tensor], layer_prefix: str, dtype: torch.dtype, vocab_maps: bool = True
) -> dict[str, torch.Tensor]:
    """The draft's tensors under the engine's names, floating ones cast to ``dtype`` (d2t int64, t2d bool kept;
    left out without ``vocab_maps``, see ``ExportSpec.vocab_maps``)."""
    out = {}
    for name, tensor in state.items():
        if name in ("heads.d2t", "heads.t2d") and not vocab_maps:
            continue
        if name in TOP:
            new = TOP[name]
        elif name in LAYER:
            new = layer_prefix + LAYER[name]
        elif name.startswith("layers."):  # a block draft's layers carry the engine's names already
            new = name
        else:
            raise KeyError(f"no engine name for draft tensor {name!r}")
        t = tensor.detach().cpu()
        out[new] = (t.to(dtype) if t.is_floating_point() else t).contiguous()
    return out


def expected_shapes(spec: ExportSpec, layer_prefix: str) -> dict[str, tuple[int, ...]]:
    """Every tensor the format holds for ``spec.draft``, by engine name, with its shape."""
    c = spec.draft
    d, q, kv, inter = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, \
        c.intermediate_size
    if c.drafts_blocks:
        return block_shapes(spec)
    attn_in = 2 * d if c.arch == "eagle3" else d  # EAGLE-3's q/k/v read cat(norm(embed), norm(feature))
    # (Beagle's q reads the embedding, its k/v the states: both d wide)
    shapes = {
        "self_attn.q_proj.weight": (q, attn_in),
        "self_attn.k_proj.weight": (kv, attn_in),
        "self_attn.v_proj.weight": (kv, attn_in),
        "self_attn.o_proj.weight": (d, q),
        "mlp.gate_proj.weight": (inter, d),
        "mlp.up_proj.weight": (inter, d),
        "mlp.down_proj.weight": (d, inter),
        "post_attention_layernorm.weight": (d,),
    }
    out = {layer_prefix + k: v for k, v in shapes.items()}
    if c.arch == "eagle3":
        out |= {layer_prefix + "input_layernorm.weight": (d,), layer_prefix + "hidden_norm.weight": (d,),
                "fc.weight": (d, c.feature_size)}
    elif c.arch == "beagle":
        out |= {layer_prefix + "query_norm.weight": (d,), layer_prefix + "state_norm.weight": (d,)}
        if c.aux_layers:
            out["fc.weight"] = (d, c.feature_size)
    else:
        out |= {"fc.weight": (d, 2 * d), "fc.bias": (d,)}
    if c.own_vocab:
        out |= {"norm.weight": (d,), "lm_head.weight": (c.draft_vocab_size, d)}
        if spec.vocab_maps:
            out |= {"d2t": (c.draft_vocab_size,), "t2d": (c.vocab_size,)}
    return out


def block_shapes(spec: ExportSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor of a block draft's export, by engine name, with its shape."""
    c = spec.draft
    d, q, kv, inter = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, \
        c.intermediate_size
    layer = {"input_layernorm.weight": (d,), "self_attn.q_proj.weight": (q, d), "self_attn.k_proj.weight": (kv, d),
             "self_attn.v_proj.weight": (kv, d), "self_attn.o_proj.weight": (d, q),
             "self_attn.q_norm.weight": (c.head_dim,), "self_attn.k_norm.weight": (c.head_dim,),
             "post_attention_layernorm.weight": (d,), "mlp.gate_proj.weight": (inter, d),
             "mlp.up_proj.weight": (inter, d), "mlp.down_proj.weight": (d, inter)}
    out = {f"layers.{i}.{name}": shape for i in range(c.num_layers) for name, shape in layer.items()}
    out |= {"fc.weight": (d, c.feature_size), "hidden_norm.weight": (d,), "norm.weight": (d,)}
    if c.own_vocab:
        out["lm_head.weight"] = (c.draft_vocab_size, d)
        if spec.vocab_maps:
            out |= {"d2t": (c.draft_vocab_size,), "t2d": (c.vocab_size,)}
    return out


def rope_fields(spec: ExportSpec) -> dict[str, Any]:
    """RoPE in both spellings: ``rope_parameters`` (transformers 5) and ``rope_theta``/``rope_scaling`` (older
    readers, the engines' Llama configs)."""
    rope = dict(spec.draft.rope_parameters)
    kind = rope.get("rope_type", rope.get("type", "default"))
    scaling = None if kind == "default" else {k: v for k, v in rope.items() if k != "rope_theta"}
    return {"rope_theta": float(rope.get("rope_theta", 10000.0)), "rope_scaling": scaling, "rope_parameters": rope}


def layer_config(spec: ExportSpec, architectures: list[str] | None, model_type: str = "llama") -> dict[str, Any]:
    """The HF ``LlamaConfig`` (or ``Qwen3Config``) fields of the draft's layers: geometry from the draft,
    context length and dtype from the target (or the requested dtype)."""
    c = spec.draft
    fields: dict[str, Any] = {"architectures": architectures} if architectures else {}
    return fields | {
        "model_type": model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": max(spec.target.max_position_embeddings, c.max_position_embeddings),
        **rope_fields(spec),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": spec.dtype,
    }
