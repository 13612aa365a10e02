"""One writer per format: ``config.json`` + ``model.safetensors`` the engine loads as it is.

* ``speculators`` (EAGLE-3; ``vllm serve DIR`` or vLLM's ``--speculative-config``): the
  speculators config (``Eagle3Speculator``, ``speculators_config`` with a greedy proposal of
  K tokens and the verifier, ``transformer_layer_config``) and every flag vLLM's converter
  reads written explicitly — it defaults ``norm_before_residual`` to True when absent.
* ``sglang``: EAGLE-3 as ``LlamaForCausalLMEagle3`` (``midlayer.`` names, aux ids under
  ``eagle_config`` in SGLang's output-of-layer-k convention), EAGLE-1/2 as
  ``LlamaForCausalLMEagle``. SGLang drops tensors it does not know silently, so names matter.
* ``eagle``: the EAGLE reference layout (``cnets1.Model``: one Llama layer, fc with ``bias``).
* ``speculators`` for a block draft ("DFlash: Block Diffusion for Flash Speculative Decoding"; vLLM's
  speculators type ``dflash``, ``update_dflash``): ``DFlashSpeculator`` with a Qwen3 ``transformer_layer_config``
  of ``num_layers`` layers, ``block_size``, ``mask_token_id``, ``aux_hidden_state_layer_ids`` (vLLM's
  convention) and ``sliding_window_non_causal`` True — vLLM makes the draft CAUSAL when that flag is false, and
  a DFlash block attends bidirectionally.

No format carries the target's embedding: every engine takes it from the target (vLLM uses a
draft's own ``embed_tokens`` when present, so a copy would only risk a stale or random one).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from specdraft.export.llama import engine_tensors, layer_config
from specdraft.export.spec import ExportSpec
from specdraft.placement import resolve_dtype


def aux_fields(spec: ExportSpec) -> dict[str, Any]:
    """The auxiliary-layer ids in each of the format's own conventions (nested paths as dicts)."""
    out: dict[str, Any] = {}
    for path, offset in spec.layout.aux_ids:
        *parents, key = path.split(".")
        node = out
        for parent in parents:
            node = node.setdefault(parent, {})
        node[key] = [i + offset for i in spec.draft.aux_layers]
    return out


def speculators_header(spec: ExportSpec, algorithm: str) -> dict[str, Any]:
    """The speculators fields every type shares: architectures, type, a greedy proposal of K tokens, the verifier."""
    target = spec.target
    return {
        "architectures": list(spec.layout.architectures),
        "speculators_model_type": algorithm,
        "speculators_config": {
            "algorithm": algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": spec.speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": spec.verifier or target.path, "architectures": target.architectures},
        },
    }


def speculators_config(spec: ExportSpec) -> dict[str, Any]:
    c = spec.draft
    if c.drafts_blocks:
        return dflash_config(spec)
    return {
        **speculators_header(spec, "eagle3"),
        "transformer_layer_config": layer_config(spec, None),
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size or c.hidden_size,
        "norm_before_residual": c.norm_before_residual,
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,  # the draft feeds its pre-norm state back, as EAGLE-3 does
        **aux_fields(spec),
        "torch_dtype": spec.dtype,
    }


def dflash_config(spec: ExportSpec) -> dict[str, Any]:
    c = spec.draft
    return {
        **speculators_header(spec, "dflash"),
        "transformer_layer_config": layer_config(spec, None, model_type="qwen3"),
        "draft_vocab_size": c.output_vocab_size,  # the target's vocabulary: vLLM shares its lm_head, no d2t
        "target_hidden_size": c.target_hidden_size or c.hidden_size,
        "block_size": c.block_size,
        "mask_token_id": c.mask_token_id,
        "sliding_window_non_causal": True,  # vLLM: dflash_config.causal = not this flag (absent: True)
        **aux_fields(spec),
        "torch_dtype": spec.dtype,
    }


def sglang_config(spec: ExportSpec) -> dict[str, Any]:
    c, layout = spec.draft, spec.layout
    config = layer_config(spec, list(layout.architectures))
    if c.arch == "eagle3":
        config |= {"draft_vocab_size": c.draft_vocab_size, "target_hidden_size": c.target_hidden_size or c.hidden_size,
                   "norm_before_residual": c.norm_before_residual, **aux_fields(spec)}
        config["eagle_config"]["use_aux_hidden_state"] = True
    return config


def eagle_config(spec: ExportSpec) -> dict[str, Any]:
    config = layer_config(spec, list(spec.layout.architectures))
    if config["rope_scaling"] is not None:  # the reference accepts exactly {"type", "factor"}
        config["rope_scaling"] = {"type": config["rope_scaling"].get("rope_type", config["rope_scaling"].get("type")),
                                  "factor": float(config["rope_scaling"]["factor"])}
    return config | {"bias": True}  # cnets1.Model(bias=config["bias"]): our fc has one


def vllm_config(spec: ExportSpec) -> dict[str, Any]:
    """specdraft's plugin architectures (``specdraft/serving/vllm_models.py``): the one-layer Llama config, with
    the EAGLE-3 side (draft vocabulary, target width, auxiliary layers in vLLM's convention) for Beagle over
    EAGLE-3 features. No ``bias`` key: vLLM's Llama layer would read it as an attention bias."""
    c = spec.draft
    config = layer_config(spec, list(spec.layout.architectures))
    if c.aux_layers:
        config |= {"draft_vocab_size": c.draft_vocab_size, "target_hidden_size": c.target_hidden_size or c.hidden_size,
                   **aux_fields(spec)}
    return config


CONFIGS = {"speculators": speculators_config, "vllm": vllm_config, "sglang": sglang_config, "eagle": eagle_config}


def write_export(state: dict[str, torch.Tensor], spec: ExportSpec, out: Path) -> None:
    """Write the format's ``config.json`` and ``model.safetensors`` for the draft tensors ``state`` into ``out``."""
    tensors = engine_tensors(state, spec.layout.layer_prefix, resolve_dtype(spec.dtype, torch.device("cpu")),
                             spec.vocab_maps)
    (out / "config.json").write_text(json.dumps(CONFIGS[spec.format](spec), indent=2) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
