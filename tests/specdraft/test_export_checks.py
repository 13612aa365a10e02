"""Every known export failure of the anchors (README "Serving a draft") is caught by the exporter's check.

Each test takes a correct export, breaks it the way the anchors broke theirs (missing d2t, d2t as
absolute ids, aux ids off by one, an embedding copy, max_position_embeddings left at 2048, another
dtype, ...) and asserts that ``check_export`` refuses it with the precise reason. Drafts here are
random tiny ones on a random 4-layer Llama target (the names and numbers are what is checked).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import specdraft.export.spec as spec_module
from specdraft.export import ExportError, check_export, export_draft, export_spec
from specdraft.export.spec import LAYOUTS
from specdraft.models import build_draft, draft_config_from_target, save_draft
from tests.specdraft.decoding.decoding_helpers import tiny_draft, tiny_target


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A saved random 4-layer target (context 4096) with a saved EAGLE-3 (aux 0, 1, 2) and EAGLE draft."""
    root = tmp_path_factory.mktemp("checks")
    target = tiny_target(num_hidden_layers=4, max_position_embeddings=4096)
    target.save_pretrained(root / "target")
    drafts = {arch: save_draft(tiny_draft(target, arch), root / arch) for arch in ("eagle3", "eagle", "dflash")}
    return root / "target", drafts


def exported(setup, tmp_path, arch: str, fmt: str) -> tuple[Path, object]:
    target, drafts = setup
    out = export_draft(drafts[arch], fmt, tmp_path / fmt, target=target)
    check_export(out, export_spec(drafts[arch], fmt, target=target))  # the untouched export passes
    return out, export_spec(drafts[arch], fmt, target=target)


def edit_config(out: Path, change) -> None:
    config = json.loads((out / "config.json").read_text())
    change(config)
    (out / "config.json").write_text(json.dumps(config))


def edit_tensors(out: Path, change) -> None:
    tensors = load_file(str(out / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(out / "model.safetensors"))


@pytest.mark.parametrize("fmt", ["speculators", "sglang"])
def test_missing_d2t(setup, tmp_path, fmt):
    out, spec = exported(setup, tmp_path, "eagle3", fmt)
    edit_tensors(out, lambda t: t.pop("d2t"))
    with pytest.raises(ExportError, match="d2t is missing: vLLM then maps draft id i to target id i"):
        check_export(out, spec)


@pytest.mark.parametrize("fmt", ["speculators", "sglang"])
def test_d2t_written_as_absolute_ids(setup, tmp_path, fmt):
    out, spec = exported(setup, tmp_path, "eagle3", fmt)
    edit_tensors(out, lambda t: t.update(d2t=torch.arange(t["d2t"].numel()) + t["d2t"]))  # the target ids themselves
    with pytest.raises(ExportError, match="d2t holds absolute target ids, not offsets"):
        check_export(out, spec)


def test_t2d_that_disagrees_with_d2t(setup, tmp_path):
    out, spec = exported(setup, tmp_path, "eagle3", "speculators")

    def flip(t):
        t2d = t["t2d"].clone()
        t2d[int(torch.nonzero(~t2d)[0])] = True  # one target id too many
        t["t2d"] = t2d

    edit_tensors(out, flip)
    with pytest.raises(ExportError, match="d2t and t2d disagree"):
        check_export(out, spec)


def test_aux_ids_off_by_one_for_sglang(setup, tmp_path):
    """The classic: HF hidden_states indices written where SGLang expects the output of layer k."""
    out, spec = exported(setup, tmp_path, "eagle3", "sglang")
    edit_config(out, lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[0, 1, 2]))
    with pytest.raises(ExportError, match=r"eagle_config.eagle_aux_hidden_state_layer_ids = \[0, 1, 2\] is off by one "
                                          r"\(\+1\).*must be \[-1, 0, 1\]"):
        check_export(out, spec)


def test_aux_ids_off_by_one_for_vllm(setup, tmp_path):
    """SGLang-convention ids written into the speculators config vLLM reads."""
    out, spec = exported(setup, tmp_path, "eagle3", "speculators")
    edit_config(out, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[-1, 0, 1]))
    with pytest.raises(ExportError, match=r"off by one \(-1\).*the state entering layer i \(vLLM\)"):
        check_export(out, spec)
    edit_config(out, lambda c: c.pop("eagle_aux_hidden_state_layer_ids"))
    with pytest.raises(ExportError, match=r"eagle_aux_hidden_state_layer_ids is missing: the engine would capture its "
                                          r"default layers"):
        check_export(out, spec)


@pytest.mark.parametrize("arch,fmt", [("eagle3", "speculators"), ("eagle3", "sglang"), ("eagle", "sglang"),
                                      ("eagle", "eagle")])
def test_embedding_copy_in_a_format_that_shares_the_targets(setup, tmp_path, arch, fmt):
    out, spec = exported(setup, tmp_path, arch, fmt)
    edit_tensors(out, lambda t: t.update({"embed_tokens.weight": torch.randn(128, 64)}))  # random, as the anchors'
    with pytest.raises(ExportError, match=r"\['embed_tokens.weight'\] present: the engines would use this copy"):
        check_export(out, spec)


def test_embedding_absent_where_a_format_reads_the_drafts_own(setup, tmp_path, monkeypatch):
    """No shipped format needs one (every engine shares the target's); a layout that did is held to it."""
    out, spec = exported(setup, tmp_path, "eagle3", "speculators")
    key = ("speculators", "eagle3")
    patched = dict(LAYOUTS)
    patched[key] = type(LAYOUTS[key])(**{**{f: getattr(LAYOUTS[key], f) for f in LAYOUTS[key].__slots__},
                                         "embedding": True})
    monkeypatch.setattr(spec_module, "LAYOUTS", patched)
    with pytest.raises(ExportError, match="embed_tokens.weight is missing: this format reads the draft's own"):
        check_export(out, spec)


@pytest.mark.parametrize("arch,fmt,where", [("eagle3", "speculators", "transformer_layer_config"),
                                            ("eagle3", "sglang", None), ("eagle", "eagle", None)])
def test_max_position_embeddings_left_at_2048(setup, tmp_path, arch, fmt, where):
    out, spec = exported(setup, tmp_path, arch, fmt)
    assert spec.target.max_position_embeddings == 4096
    edit_config(out, lambda c: (c[where] if where else c).update(max_position_embeddings=2048))
    with pytest.raises(ExportError, match="max_position_embeddings = 2048 is below the target's 4096"):
        check_export(out, spec)


def test_dtype_other_than_the_targets(setup, tmp_path):
    out, spec = exported(setup, tmp_path, "eagle3", "speculators")
    assert spec.dtype == "float32"  # from the target's config
    edit_tensors(out, lambda t: t.update({k: v.half() for k, v in t.items() if v.is_floating_point()}))
    with pytest.raises(ExportError, match="fc.weight is float16, not the requested/target dtype float32"):
        check_export(out, spec)
    out2 = export_draft(setup[1]["eagle3"], "sglang", tmp_path / "bf16", target=setup[0], dtype="bfloat16")
    edit_config(out2, lambda c: c.update(torch_dtype="float32"))
    with pytest.raises(ExportError, match="torch_dtype = 'float32', expected 'bfloat16'"):
        check_export(out2, export_spec(setup[1]["eagle3"], "sglang", target=setup[0], dtype="bfloat16"))


def test_layer_names_the_engine_does_not_know(setup, tmp_path):
    """SGLang drops unknown names silently: vLLM's layers.0.* in an SGLang directory leaves midlayer random."""
    out, spec = exported(setup, tmp_path, "eagle3", "sglang")
    edit_tensors(out, lambda t: t.update({k.replace("midlayer.", "layers.0."): t.pop(k) for k in list(t)
                                          if k.startswith("midlayer.")}))
    with pytest.raises(ExportError, match=r"missing tensors \['midlayer.hidden_norm.weight'.*random init.*unexpected "
                                          r"tensors \['layers.0.hidden_norm.weight'"):
        check_export(out, spec)


def test_flags_the_engines_default_differently(setup, tmp_path):
    out, spec = exported(setup, tmp_path, "eagle3", "speculators")
    edit_config(out, lambda c: c.pop("norm_before_residual"))
    with pytest.raises(ExportError, match=r"norm_before_residual = None, the draft has False \(vLLM defaults it to True"):
        check_export(out, spec)
    ref, spec = exported(setup, tmp_path, "eagle", "eagle")
    edit_config(ref, lambda c: c.update(bias=False))
    with pytest.raises(ExportError, match="the EAGLE reference then builds fc without its bias"):
        check_export(ref, spec)
    sgl, spec = exported(setup, tmp_path, "eagle", "sglang")
    edit_config(sgl, lambda c: c.update(tie_word_embeddings=True, bias=True))
    with pytest.raises(ExportError, match="tie_word_embeddings = True, the draft has False.*attention bias"):
        check_export(sgl, spec)
    (sgl / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ExportError, match=r"other weight files \['pytorch_model.bin'\]"):
        check_export(sgl, spec)


def test_exporter_refuses_drafts_the_engines_cannot_reproduce(setup, tmp_path):
    target_dir, drafts = setup
    target = tiny_target(num_hidden_layers=4, max_position_embeddings=4096)

    def draft_dir(name, **kw):
        cfg = draft_config_from_target(target.config, "eagle3", draft_vocab_size=100, **kw)
        vocab = torch.arange(100)
        return save_draft(build_draft(cfg, target.get_input_embeddings().weight, target.lm_head.weight, vocab=vocab),
                          tmp_path / name)

    with pytest.raises(ExportError, match="not strictly increasing"):
        export_draft(draft_dir("perm", aux_layers=[2, 0, 1]), "speculators", tmp_path / "o", target=target_dir)
    with pytest.raises(ExportError, match=r"index 4 is the final normed state"):
        export_draft(draft_dir("last", aux_layers=[1, 2, 4]), "speculators", tmp_path / "o", target=target_dir)
    with pytest.raises(ExportError, match="read exactly 3 auxiliary target layers"):
        export_draft(draft_dir("two", aux_layers=[1, 2]), "speculators", tmp_path / "o", target=target_dir)
    config = json.loads((drafts["eagle3"] / "config.json").read_text())
    nbr = tmp_path / "nbr"
    nbr.mkdir()
    (nbr / "config.json").write_text(json.dumps({**config, "norm_before_residual": True}))
    (nbr / "model.safetensors").write_bytes((drafts["eagle3"] / "model.safetensors").read_bytes())
    with pytest.raises(ExportError, match="SGLang's LlamaForCausalLMEagle3 takes the residual before hidden_norm"):
        export_draft(nbr, "sglang", tmp_path / "o", target=target_dir)
    export_draft(nbr, "speculators", tmp_path / "ok", target=target_dir)  # vLLM reproduces it
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**config, "target_id": "somewhere@0123456789abcdef"}))
    (other / "model.safetensors").write_bytes((drafts["eagle3"] / "model.safetensors").read_bytes())
    with pytest.raises(ExportError, match="the draft was trained on target somewhere@0123456789abcdef"):
        export_draft(other, "speculators", tmp_path / "o", target=target_dir)
    assert not (tmp_path / "o").exists()


# --------------------------------------------------------------------------- vLLM 0.32's quirks (README "Serving a draft")


@pytest.fixture(scope="module")
def vllm_drafts(setup, tmp_path_factory):
    """Beagle, Beagle over EAGLE-3 features, and an EAGLE-3 draft over the target's whole vocabulary."""
    target_dir, _ = setup
    target = tiny_target(num_hidden_layers=4, max_position_embeddings=4096)
    root = tmp_path_factory.mktemp("vllm-drafts")
    out = {arch: save_draft(tiny_draft(target, arch), root / arch) for arch in ("beagle", "beagle3")}
    vocab = target.config.vocab_size
    out["eagle3-full"] = save_draft(tiny_draft(target, "eagle3", draft_vocab=vocab), root / "eagle3-full")
    return target_dir, out


def test_a_top_level_bias_key_is_vllms_attention_bias(setup, tmp_path):
    """vLLM's Llama layer reads ``attention_bias or bias``: q/k/v/o get uninitialised biases, 0 accepted tokens."""
    out, spec = exported(setup, tmp_path, "eagle", "vllm")
    assert "bias" not in json.loads((out / "config.json").read_text())
    edit_config(out, lambda c: c.update(bias=True))
    with pytest.raises(ExportError, match="a top-level 'bias' key: vLLM and SGLang read it as the attention bias"):
        check_export(out, spec)


def test_vllms_own_eagle_class_would_drop_the_fc_bias(setup, tmp_path):
    out, spec = exported(setup, tmp_path, "eagle", "vllm")
    assert "fc.bias" in load_file(str(out / "model.safetensors"))
    edit_config(out, lambda c: c.update(architectures=["LlamaForCausalLM"]))  # what vLLM maps to its EAGLE-1 class
    with pytest.raises(ExportError, match="builds fc without a bias and drops the checkpoint's fc.bias"):
        check_export(out, spec)


def test_an_architecture_the_plugin_does_not_register(vllm_drafts, tmp_path):
    target, drafts = vllm_drafts
    out = export_draft(drafts["beagle"], "vllm", tmp_path / "b", target=target)
    edit_config(out, lambda c: c.update(architectures=["BeagleLlamaForCausalLM"]))  # vLLM would prefix Eagle
    with pytest.raises(ExportError, match="not registered by specdraft's vLLM plugin"):
        check_export(out, export_spec(drafts["beagle"], "vllm", target=target))


def test_vocab_maps_for_a_full_draft_vocabulary_are_refused_by_vllm(vllm_drafts, tmp_path):
    """vLLM creates draft_id_to_target_id only for a smaller draft vocabulary and refuses the tensors otherwise."""
    target, drafts = vllm_drafts
    out = export_draft(drafts["eagle3-full"], "speculators", tmp_path / "s", target=target)
    assert not {"d2t", "t2d"} & set(load_file(str(out / "model.safetensors")))
    spec = export_spec(drafts["eagle3-full"], "speculators", target=target)
    state = load_file(str(drafts["eagle3-full"] / "model.safetensors"))
    edit_tensors(out, lambda t: t.update(d2t=state["heads.d2t"], t2d=state["heads.t2d"]))
    with pytest.raises(ExportError, match=r"\['d2t', 't2d'\] present .*refuses to load"):
        check_export(out, spec)
    sgl = export_draft(drafts["eagle3-full"], "sglang", tmp_path / "g", target=target)  # SGLang reads them: kept
    assert {"d2t", "t2d"} <= set(load_file(str(sgl / "model.safetensors")))


def test_speculators_layer_types_vllm_can_build(setup, tmp_path):
    out, spec = exported(setup, tmp_path, "eagle3", "speculators")
    edit_config(out, lambda c: c["transformer_layer_config"].update(model_type="mistral"))
    with pytest.raises(ExportError, match="builds only 'llama' or 'qwen3' draft layers"):
        check_export(out, spec)


def test_beagle_over_eagle3_features_keeps_its_aux_ids_in_vllms_convention(vllm_drafts, tmp_path):
    target, drafts = vllm_drafts
    out = export_draft(drafts["beagle3"], "vllm", tmp_path / "b3", target=target)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Eagle3SpecdraftBeagleForCausalLM"] and config["draft_vocab_size"] == 100
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    edit_config(out, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 2, 3]))
    with pytest.raises(ExportError, match=r"eagle_aux_hidden_state_layer_ids = \[1, 2, 3\] is off by one"):
        check_export(out, export_spec(drafts["beagle3"], "vllm", target=target))


@pytest.mark.parametrize("change,reason", [
    (lambda c: c.update(sliding_window_non_causal=False), "vLLM then builds the draft's attention CAUSAL"),
    (lambda c: c["transformer_layer_config"].pop("rope_parameters"), "falls back to 1e6 when it is missing"),
    (lambda c: c.update(mask_token_id=c["mask_token_id"] - 1), "mask_token_id = .*, the draft has"),
    (lambda c: c.update(block_size=8), "block_size = 8, the draft has 5"),
    (lambda c: c.update(aux_hidden_state_layer_ids=[i - 1 for i in c["aux_hidden_state_layer_ids"]]),
     "aux_hidden_state_layer_ids = .* is off by one"),
    (lambda c: c["transformer_layer_config"].update(num_hidden_layers=1), "num_hidden_layers = 1, the draft has 2"),
], ids=["causal", "rope-theta", "mask-token", "block-size", "aux-ids", "layers"])
def test_block_draft_config_vllm_would_misread(setup, tmp_path, change, reason):
    out, spec = exported(setup, tmp_path, "dflash", "speculators")
    edit_config(out, change)
    with pytest.raises(ExportError, match=reason):
        check_export(out, spec)
