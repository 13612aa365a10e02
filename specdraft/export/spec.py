"""What an export must produce (docs/serving.md): the draft, the facts taken from its target, the format.

The facts an engine needs but a draft directory does not hold come from the target's own
``config.json``: its context length (``max_position_embeddings`` — a draft config left at 2048
caps the served context), its dtype (the default of the exported tensors), its layer count
(an auxiliary layer must be one the engines can capture) and its architectures (the
``verifier`` of a speculators config). ``ExportSpec`` gathers them with the chosen format;
the writers read it, and ``check_export`` checks the written files against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from specdraft import placement
from specdraft.configs.draft import DraftConfig
from specdraft.targets import Target
from specdraft.targets.identity import TargetMismatch, check_pairing, target_id
from specdraft.targets.loading import load_target_config

FORMATS = ("speculators", "vllm", "sglang", "eagle")
DTYPES = tuple(placement.DTYPES)  # the dtype names an export writes
VLLM_FORMATS = ("speculators", "vllm")  # read by vLLM (``vllm``: with specdraft's plugin, specdraft.serving)
# by draft variant (``variant``): the formats an engine loads it from exactly, the first the one the flow serves
VARIANT_FORMATS = {"eagle3": ("speculators", "sglang"), "eagle": ("vllm", "sglang", "eagle"), "beagle": ("vllm",),
                   "beagle3": ("vllm",), "dflash": ("speculators",), "beagle-dflash": ()}


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """Where a format keeps what the engine reads (verified against the engines' loaders)."""

    architectures: tuple[str, ...]  # config.json "architectures": picks the engine's model class
    layer_prefix: str  # the decoder layer's tensor prefix
    layer_config: str | None = None  # key of the nested Llama layer config (None: at the top level)
    aux_ids: tuple[tuple[str, int], ...] = ()  # (config path, offset added to the HF hidden_states index)
    embedding: bool = False  # whether the checkpoint must carry the embedding (none does: engines share the target's)
    method: str = ""  # vLLM's speculative method for it ("" : not a vLLM format)
    plugin: bool = False  # the architecture is specdraft's (vLLM needs specdraft installed: its plugin registers it)


LAYOUTS = {
    # vLLM reads the speculators config: eagle_aux_hidden_state_layer_ids are HF hidden_states indices
    # (the state entering decoder layer i); tensors layers.0.*; the target's embedding is shared.
    ("speculators", "eagle3"): Layout(architectures=("Eagle3Speculator",), layer_prefix="layers.0.",
                                      layer_config="transformer_layer_config",
                                      aux_ids=(("eagle_aux_hidden_state_layer_ids", 0),), method="eagle3"),
    # specdraft's plugin classes (specdraft/serving/vllm_models.py), named as vLLM's EAGLEConfig leaves them:
    # EAGLE-1/2 with its fc bias, Beagle over the last state, Beagle over the EAGLE-3 features
    ("vllm", "eagle"): Layout(architectures=("EagleSpecdraftLlamaForCausalLM",), layer_prefix="layers.0.",
                              method="eagle", plugin=True),
    ("vllm", "beagle"): Layout(architectures=("EagleSpecdraftBeagleForCausalLM",), layer_prefix="layers.0.",
                               method="eagle", plugin=True),
    ("vllm", "beagle3"): Layout(architectures=("Eagle3SpecdraftBeagleForCausalLM",), layer_prefix="layers.0.",
                                aux_ids=(("eagle_aux_hidden_state_layer_ids", 0),), method="eagle3", plugin=True),
    # SGLang: explicit ids under eagle_config mean the OUTPUT of layer k (it captures k + 1); the top-level
    # list, in vLLM's convention, is for vLLM reading the same directory (it maps midlayer. to layers.0.).
    ("sglang", "eagle3"): Layout(architectures=("LlamaForCausalLMEagle3",), layer_prefix="midlayer.",
                                 aux_ids=(("eagle_config.eagle_aux_hidden_state_layer_ids", -1),
                                          ("eagle_aux_hidden_state_layer_ids", 0))),
    ("sglang", "eagle"): Layout(architectures=("LlamaForCausalLMEagle",), layer_prefix="layers.0."),
    ("eagle", "eagle"): Layout(architectures=("LlamaForCausalLM",), layer_prefix="layers.0."),
    # vLLM's speculators "dflash" type (update_dflash -> DFlashDraftModel = DFlashQwen3ForCausalLM): the draft's own
    # multi-layer names (layers.i.self_attn.*, top-level fc / hidden_norm / norm); aux_hidden_state_layer_ids in
    # vLLM's convention (the state entering layer i), turned by vLLM into dflash_config.target_layer_ids = i - 1
    ("speculators", "dflash"): Layout(architectures=("DFlashSpeculator",), layer_prefix="",
                                      layer_config="transformer_layer_config",
                                      aux_ids=(("aux_hidden_state_layer_ids", 0),), method="dflash"),
}


class ExportError(ValueError):
    """A draft that cannot be exported to a format, or an exported directory an engine would misread."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TargetFacts:
    path: str  # the target directory (absolute): the verifier the engine loads unless ExportSpec.verifier says
    target_id: str  # specdraft's identity of the target directory (``specdraft.targets.identity.target_id``)
    architectures: list[str] = field(default_factory=list)
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    dtype: str | None  # the dtype its config declares (None: not declared)


@dataclass(frozen=True, kw_only=True, slots=True)
class ExportSpec:
    format: str
    draft: DraftConfig
    target: TargetFacts
    dtype: str  # of every floating tensor written (the target's unless asked otherwise)
    speculative_tokens: int = 3  # K proposed per step (speculators' greedy proposal; serve commands)
    verifier: str = ""  # name_or_path written for the verifier; empty: the target path

    @property
    def layout(self) -> Layout:
        return LAYOUTS[(self.format, variant(self.draft))]

    @property
    def vocab_maps(self) -> bool:
        """Whether the checkpoint carries ``d2t``/``t2d``: a draft vocabulary, except where it is the whole
        target vocabulary and vLLM reads it (vLLM builds its id map only for a smaller draft vocabulary and
        refuses the tensors otherwise; speculators' trainer leaves them out)."""
        c = self.draft
        if not c.own_vocab:
            return False
        return not (self.format in VLLM_FORMATS and c.draft_vocab_size == c.vocab_size)


def variant(config: DraftConfig) -> str:
    """The draft as the engines see it: its arch, ``beagle3`` for Beagle over EAGLE-3 features and
    ``beagle-dflash`` for a block draft whose positions do not attend to each other."""
    if config.drafts_blocks and not config.block_self_attention:
        return "beagle-dflash"
    return "beagle3" if config.arch == "beagle" and config.aux_layers else config.arch


def read_target_facts(path: Target | str | Path) -> TargetFacts:
    """The facts of the target directory ``path`` (from its ``config.json``)."""
    path = Target.of(path)
    cfg = load_target_config(path)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    dtype = getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
    dtype = placement.dtype_name(dtype) if dtype is not None else None
    return TargetFacts(
        path=str(path.path),
        target_id=target_id(path),
        architectures=list(getattr(cfg, "architectures", None) or []),
        num_hidden_layers=int(text.num_hidden_layers),
        hidden_size=int(text.hidden_size),
        vocab_size=int(text.vocab_size),
        max_position_embeddings=int(getattr(text, "max_position_embeddings", 0) or 0),
        dtype=dtype if dtype in DTYPES else None,
    )


def default_speculative_tokens(config: DraftConfig) -> int:
    """K when none is asked for: a block draft's masked positions (block_size - 1), else 3."""
    return config.block_size - 1 if config.drafts_blocks else 3


def formats_for(config: DraftConfig) -> tuple[str, ...]:
    """The formats an engine loads the draft ``config`` from exactly, the one the flow serves first."""
    return VARIANT_FORMATS.get(variant(config), ())


def refuse_unservable(config: DraftConfig, fmt: str) -> None:
    """Raise ``ExportError`` with the reason when ``config`` cannot be written exactly in ``fmt``."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; choose one of {list(FORMATS)}")
    if config.drafts_blocks and not config.block_self_attention:
        raise ExportError(
            "this block draft's positions never attend to each other (the beagle-dflash recipe); vLLM's DFlash layer "
            "always attends within the block, so its exported weights would not reproduce the draft's logits. "
            "Evaluate it with `specdraft eval`, or train the dflash recipe to serve one"
        )
    if config.legacy:
        raise ExportError(
            "this EAGLE draft was written by specdraft 0.1 (an RMSNorm on the fc output and a zero-state slot at "
            "position 0); the engines' EAGLE layer has neither, so its exported weights would not reproduce its "
            "logits. Retrain it with this version (recipes eagle / hass) to export it"
        )
    if config.own_vocab and not config.aux_layers:
        raise ExportError(
            f"this {config.arch} draft has its own head over a draft vocabulary of {config.draft_vocab_size} tokens but "
            "reads the target's last hidden state; vLLM serves a draft vocabulary only on its EAGLE-3 path (through "
            "d2t), where the draft reads the EAGLE-3 features. Retrain it with recipe beagle3 or eagle3"
        )
    if fmt not in formats_for(config):
        engines = " (only vLLM serves Beagle drafts, through specdraft's plugin)" if config.arch == "beagle" else ""
        raise ExportError(
            f"format {fmt!r} cannot carry a {variant(config)!r} draft{engines}; formats for it: "
            f"{list(formats_for(config))}"
        )
    if config.arch == "eagle3":
        if len(config.aux_layers) != 3:
            raise ExportError(
                f"vLLM's and SGLang's EAGLE-3 drafts read exactly 3 auxiliary target layers (fc over 3*d); this draft "
                f"reads {len(config.aux_layers)}: {config.aux_layers}"
            )
        if fmt == "sglang" and config.norm_before_residual:
            raise ExportError(
                "SGLang's LlamaForCausalLMEagle3 takes the residual before hidden_norm; this draft uses "
                "norm_before_residual=True, which only vLLM reproduces: export it as 'speculators' instead"
            )
    if fmt == "eagle":
        if config.head_dim * config.num_attention_heads != config.hidden_size:
            raise ExportError(
                f"the EAGLE reference derives head_dim = hidden_size / heads = "
                f"{config.hidden_size // config.num_attention_heads}; this draft has head_dim {config.head_dim}"
            )
        rope_type = config.rope_parameters.get("rope_type", config.rope_parameters.get("type", "default"))
        if rope_type not in ("default", "linear", "dynamic"):
            raise ExportError(f"the EAGLE reference knows RoPE default/linear/dynamic only, not {rope_type!r}")


def refuse_unknown_target(config: DraftConfig, target: TargetFacts) -> None:
    """The draft must have been trained on this target (identity, widths, auxiliary layers)."""
    if config.target_id or config.target_fingerprint:  # the one pairing check (specdraft.targets.identity.check_pairing)
        try:
            check_pairing("being exported", {"target_id": config.target_id, "target_fingerprint": config.target_fingerprint},
                         target.path, what="draft", legacy_mismatch="error")
        except TargetMismatch as err:
            raise ExportError(f"the draft was trained on target {config.target_id or '?'}: {err}") from None
    if (config.vocab_size, config.target_hidden_size or config.hidden_size) != (target.vocab_size, target.hidden_size):
        raise ExportError(
            f"draft vocab/width {(config.vocab_size, config.target_hidden_size)} do not match the target's "
            f"{(target.vocab_size, target.hidden_size)}"
        )
    aux = list(config.aux_layers)
    if aux != sorted(set(aux)):
        raise ExportError(
            f"auxiliary layers {aux} are not strictly increasing: the engines capture each layer once, in layer order, "
            "and concatenate the states in that order, so the draft's fc would read them permuted"
        )
    bad = [i for i in aux if not 0 <= i < target.num_hidden_layers]
    if bad:
        raise ExportError(
            f"auxiliary layers {bad} are not states the engines can capture: they capture the state entering decoder "
            f"layer i for 0 <= i < {target.num_hidden_layers} (index {target.num_hidden_layers} is the final normed "
            "state, which they never hand to the draft)"
        )
