"""Tests for specdraft.targets: heads from safetensors, hidden/logit extraction, identity."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from specdraft.targets import checkpoint, identity, loading, states
from specdraft.features import resolve_aux_layers
from tests import tiny_models

FAMILIES = {**tiny_models.FAMILIES, "qwen3": (Qwen3Config, Qwen3ForCausalLM)}
VOCAB = 128
TINY = {**tiny_models.TINY, "vocab_size": VOCAB, "max_position_embeddings": 256}


def build_tiny(family: str, tie: bool = False, seed: int = 0):
    config_cls, model_cls = FAMILIES[family]
    torch.manual_seed(seed)
    return model_cls(config_cls(**TINY, tie_word_embeddings=tie)).eval()


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def saved(request, tmp_path_factory):
    """(family, model, dir) for a single-file save of each family."""
    model = build_tiny(request.param)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, model, path


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    model = build_tiny("llama", seed=1)
    path = tmp_path_factory.mktemp("sharded")
    model.save_pretrained(path, max_shard_size="20KB")
    return model, path


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    model = build_tiny("qwen3", tie=True, seed=2)
    path = tmp_path_factory.mktemp("tied")
    model.save_pretrained(path)
    return model, path


def assert_heads_match(heads: loading.TargetHeads, model) -> None:
    assert torch.equal(heads.embed, model.get_input_embeddings().weight)
    assert torch.equal(heads.lm_head, model.get_output_embeddings().weight)
    assert heads.embed.shape == (VOCAB, TINY["hidden_size"])


# --- config, tokenizer, model ---------------------------------------------------------------


def test_load_target_config(saved):
    family, _, path = saved
    config = loading.load_target_config(path)
    assert config.model_type == family
    assert config.hidden_size == TINY["hidden_size"]


def test_load_tokenizer_keeps_chat_template(tmp_path):
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", "user", "hello", "world"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="</s>", chat_template=template
    )
    tok.save_pretrained(tmp_path)
    build_tiny("llama").config.save_pretrained(tmp_path)

    loaded = loading.load_tokenizer(tmp_path)
    assert loaded.chat_template == template
    text = loaded.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False)
    assert text == "user hello "
    assert loaded("hello world").input_ids == [4, 5]


def test_load_target_model(saved):
    _, model, path = saved
    loaded = loading.load_target_model(path)
    assert not loaded.training
    assert all(not p.requires_grad for p in loaded.parameters())
    ids = torch.randint(0, VOCAB, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


# --- heads from safetensors -----------------------------------------------------------------


def test_load_target_heads_single_file(saved):
    _, model, path = saved
    heads = loading.load_target_heads(path)
    assert not heads.tied
    assert_heads_match(heads, model)


def test_load_target_heads_sharded_opens_only_needed_shards(sharded, monkeypatch):
    model, path = sharded
    index = json.loads((path / checkpoint.INDEX_FILE).read_text())["weight_map"]
    assert len(set(index.values())) > 2, "sharded save should produce several shards"

    opened = []
    real_safe_open = loading.safe_open

    def recording_safe_open(file, *args, **kwargs):
        opened.append(file)
        return real_safe_open(file, *args, **kwargs)

    monkeypatch.setattr(loading, "safe_open", recording_safe_open)
    heads = loading.load_target_heads(path)
    assert_heads_match(heads, model)
    needed = {str(path / index[k]) for k in ("model.embed_tokens.weight", "lm_head.weight")}
    assert set(opened) == needed


def test_load_target_heads_tied(tied):
    model, path = tied
    heads = loading.load_target_heads(path)
    assert heads.tied
    assert heads.lm_head is heads.embed
    assert_heads_match(heads, model)


def test_load_target_heads_without_lm_head_tensor_is_tied(saved, tmp_path):
    """A checkpoint storing no lm_head counts as tied even when the config does not say so."""
    _, model, _ = saved
    model.config.save_pretrained(tmp_path)
    save_file({"model.embed_tokens.weight": model.get_input_embeddings().weight.detach()},
              str(tmp_path / "model.safetensors"))
    heads = loading.load_target_heads(tmp_path, dtype=torch.bfloat16)
    assert heads.tied and heads.embed.dtype == torch.bfloat16
    assert torch.equal(heads.lm_head, model.get_input_embeddings().weight.to(torch.bfloat16))


def test_load_target_heads_prefixed_keys(saved, tmp_path):
    _, model, _ = saved
    model.config.save_pretrained(tmp_path)
    save_file(
        {
            "model.language_model.embed_tokens.weight": model.get_input_embeddings().weight.detach(),
            "model.lm_head.weight": model.get_output_embeddings().weight.detach(),
        },
        str(tmp_path / "model.safetensors"),
    )
    assert_heads_match(loading.load_target_heads(tmp_path), model)


def test_load_target_heads_errors(saved, tmp_path):
    _, model, _ = saved
    with pytest.raises(FileNotFoundError, match="not a local directory"):
        loading.load_target_heads(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        loading.load_target_heads(tmp_path)

    model.config.save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="only safetensors"):
        loading.load_target_heads(tmp_path)

    save_file({"wrong.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError, match="candidate keys.*wrong.weight"):
        loading.load_target_heads(tmp_path)


def test_missing_shard_is_a_clear_error(sharded, tmp_path):
    _, path = sharded
    for file in path.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    index = json.loads((tmp_path / checkpoint.INDEX_FILE).read_text())["weight_map"]
    (tmp_path / index["lm_head.weight"]).unlink()
    with pytest.raises(FileNotFoundError, match="lm_head.weight"):
        loading.load_target_heads(tmp_path)


# --- hidden states and logits ---------------------------------------------------------------


def test_target_states_match_model_logits(saved):
    _, model, _ = saved
    torch.manual_seed(3)
    ids = torch.randint(0, VOCAB, (3, 9))
    hidden, logits = states.target_states(model, ids)
    assert hidden.shape == (3, 9, TINY["hidden_size"])
    assert logits.shape == (3, 9, VOCAB)
    assert not hidden.requires_grad and not logits.requires_grad
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        torch.testing.assert_close(logits, out.logits, rtol=0, atol=0)
        torch.testing.assert_close(model.get_output_embeddings()(hidden), logits, rtol=0, atol=0)
        # the last hidden state is post-norm: it is what the lm_head consumes
        torch.testing.assert_close(hidden, out.hidden_states[-1], rtol=0, atol=0)


def test_target_states_tied(tied):
    model, _ = tied
    ids = torch.randint(0, VOCAB, (2, 6))
    hidden, logits = states.target_states(model, ids)
    with torch.no_grad():
        torch.testing.assert_close(logits, model(ids).logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(hidden @ model.get_input_embeddings().weight.T, logits)


def test_target_states_left_padding(saved):
    _, model, _ = saved
    torch.manual_seed(4)
    lengths = [7, 3, 5]
    width = max(lengths)
    rows = [torch.randint(1, VOCAB, (n,)) for n in lengths]
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = row
        mask[i, width - len(row):] = 1

    hidden, logits = states.target_states(model, ids, mask)
    for i, row in enumerate(rows):
        ref_hidden, ref_logits = states.target_states(model, row[None])
        valid = slice(width - len(row), width)
        torch.testing.assert_close(hidden[i, valid], ref_hidden[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(logits[i, valid], ref_logits[0], rtol=0, atol=1e-5)
        assert torch.all(hidden[i, : width - len(row)] == 0)


def test_target_states_rejects_bad_shapes(saved):
    _, model, _ = saved
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        states.target_states(model, torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="does not match"):
        states.target_states(model, torch.zeros(2, 5, dtype=torch.long), torch.ones(2, 4))


def test_positions_from_mask():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    expected = torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]])
    assert torch.equal(states.positions_from_mask(mask), expected)


# --- identity -------------------------------------------------------------------------------


def test_target_id_is_stable_and_tracks_content(sharded, tmp_path):
    _, path = sharded
    first = identity.target_id(path)
    assert first == identity.target_id(path)
    assert first.startswith(path.name + "@")

    copy = tmp_path / path.name
    copy.mkdir()
    for file in path.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    assert identity.target_id(copy) == first

    config = json.loads((copy / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5 if config["rms_norm_eps"] != 1e-5 else 1e-6
    (copy / "config.json").write_text(json.dumps(config))
    assert identity.target_id(copy) != first


def test_target_id_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        identity.target_id(tmp_path / "missing")


# --- placement: device_map loading, attention kernels, a target spread over devices ---------
#
# No GPU here (and none lent to this work): the multi-GPU load itself is not run. What runs:
# the single-device device_map path against the pre-device_map path, SDPA vs eager numerics,
# accelerate's dispatch hooks on CPU (disk offload: real values), a two-device split simulated
# with fake tensors (shapes and devices only), and the GPU spread plan with from_pretrained
# mocked (said in each test).

from types import SimpleNamespace  # noqa: E402

from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError, FakeTensorMode  # noqa: E402
from transformers import AutoModelForCausalLM, DynamicCache  # noqa: E402

from specdraft import placement  # noqa: E402
from specdraft.decoding.drafting import advance_draft, start_draft  # noqa: E402
from specdraft.decoding.speculative import speculative_generate, vanilla_generate  # noqa: E402
from specdraft.configs.decode import DecodeConfig  # noqa: E402
from specdraft.decoding.verify import compact_cache, target_forward, verify_tree  # noqa: E402
from tests.specdraft.decoding.decoding_helpers import StubTarget, random_tree, tiny_draft, tiny_target  # noqa: E402


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama-kernels")
    tiny_target("llama", seed=5, logit_scale=4.0).save_pretrained(path)
    return path


def padded_batch(lengths: list[int], side: str, seed: int = 0, vocab: int = VOCAB) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids in [1, vocab) of ``lengths``, padded with 0 on ``side``, and their attention mask."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)  # (B, T)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)  # (B, T)
    for i, n in enumerate(lengths):
        cols = slice(0, n) if side == "right" else slice(width - n, width)
        ids[i, cols] = torch.randint(1, vocab, (n,), generator=g)
        mask[i, cols] = 1
    return ids, mask


def test_load_target_model_device_map_matches_the_plain_load(saved):
    """device 'cpu' and 'auto' (CPU here) through the device_map path give the model the
    pre-device_map code loaded (from_pretrained, then .to(device)), bit for bit."""
    _, _, path = saved
    before = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to("cpu").eval()
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    for device, dtype in (("cpu", torch.float32), ("auto", "auto")):
        model = loading.load_target_model(path, dtype, device)
        assert not model.training and all(not p.requires_grad for p in model.parameters())
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, before(ids).logits, rtol=0, atol=0)
        assert placement.describe_placement(model) == {
            "attn_implementation": "sdpa", "dtype": "float32", "devices": ["cpu"],
            "input_device": "cpu", "output_device": "cpu",
        }


def test_load_target_model_spread_plan_with_mocked_gpus(llama_dir, monkeypatch):
    """Mocked (no GPU here): free_gpu_memory and from_pretrained. Checks that gpus=4 asks
    transformers for the balanced device_map over GPUs 0..3 only, in bf16 for dtype auto, with
    sdpa, and that a returned map with offloaded modules is refused."""
    calls = []
    real = AutoModelForCausalLM.from_pretrained

    def fake_from_pretrained(path, **kwargs):
        calls.append(kwargs)
        model, info = real(path, dtype=torch.float32, output_loading_info=True)
        model.hf_device_map = outcome
        return (model, info) if kwargs.get("output_loading_info") else model

    monkeypatch.setattr(loading, "free_gpu_memory", lambda gpus: {i: 10 << 30 for i in range(gpus)})
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", fake_from_pretrained)
    outcome = {"model.embed_tokens": 0, "model.layers.0": 1, "model.layers.1": 2, "model.norm": 3, "lm_head": 3}
    loading.load_target_model(llama_dir, "auto", "auto" if torch.cuda.is_available() else "cuda", gpus=4)
    assert calls[-1]["device_map"] == "auto"
    assert calls[-1]["max_memory"] == {0: 10 << 30, 1: 10 << 30, 2: 10 << 30, 3: 10 << 30}
    assert calls[-1]["dtype"] is torch.bfloat16 and calls[-1]["attn_implementation"] == "sdpa"
    assert calls[-1]["trust_remote_code"] is False and calls[-1]["output_loading_info"] is True  # strict: checked
    outcome = {"model.embed_tokens": 0, "model.layers.0": 1, "model.layers.1": "disk", "lm_head": 1}
    with pytest.raises(ValueError, match="does not fit on 2 GPUs"):
        loading.load_target_model(llama_dir, "auto", "cuda", gpus=2)
    with pytest.raises(AssertionError, match="device must be 'auto' or 'cuda'"):
        loading.load_target_model(llama_dir, "auto", "cpu", gpus=2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without GPUs")
def test_load_target_model_spread_without_gpus_is_a_clear_error(llama_dir):
    with pytest.raises(ValueError, match="spread over 2 GPUs but this process sees 0"):
        loading.load_target_model(llama_dir, device="cuda", gpus=2)


@pytest.mark.parametrize("side", ["right", "left"])
def test_sdpa_and_eager_prefill_agree_with_padding(llama_dir, side):
    """fp32 tiny Llama: the dump's prefill (target_states) gives the same hidden states and
    logits with both kernels (1e-5), padded positions zero."""
    sdpa = loading.load_target_model(llama_dir, attn_implementation="sdpa")
    eager = loading.load_target_model(llama_dir, attn_implementation="eager")
    assert (sdpa.config._attn_implementation, eager.config._attn_implementation) == ("sdpa", "eager")
    ids, mask = padded_batch([9, 4, 6], side)
    h_s, l_s = states.target_states(sdpa, ids, mask)
    h_e, l_e = states.target_states(eager, ids, mask)
    torch.testing.assert_close(h_s, h_e, rtol=0, atol=1e-5)
    torch.testing.assert_close(l_s, l_e, rtol=0, atol=1e-5)
    assert torch.all(h_s[mask == 0] == 0) and torch.isfinite(h_s).all()


def test_sdpa_prefill_mask_is_one_boolean_mask_per_sequence(llama_dir, monkeypatch):
    """What SDPA receives in the dump's prefill: with padding, a boolean (B, 1, T, T) mask
    (one byte per entry, broadcast over heads — no float mask per head); without padding no
    mask at all (``is_causal``, so CUDA may pick its flash kernel)."""
    model = loading.load_target_model(llama_dir)
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def recording_sdpa(query, key, value, attn_mask=None, *args, **kwargs):
        seen.append((attn_mask, kwargs.get("is_causal"), tuple(query.shape)))
        return real(query, key, value, attn_mask, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa)
    ids, mask = padded_batch([9, 4, 6], "right")
    states.target_states(model, ids, mask)
    assert len(seen) == TINY["num_hidden_layers"]
    for attn_mask, is_causal, q_shape in seen:
        assert attn_mask.dtype == torch.bool and attn_mask.shape == (3, 1, 9, 9), (attn_mask.dtype, attn_mask.shape)
        assert q_shape[1] == TINY["num_attention_heads"] and not is_causal
    seen.clear()
    states.target_states(model, ids[:, :4], mask[:, :4])  # no padding in the first 4 columns
    assert all(attn_mask is None and is_causal for attn_mask, is_causal, _ in seen) and len(seen) == 2


def test_sdpa_and_eager_tree_verification_agree(llama_dir):
    """Tree verification (custom 4D additive mask, tree positions, DynamicCache) gives the same
    hidden states and logits with both kernels (fp32, 1e-5)."""
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    tree = random_tree(15, vocab=VOCAB, seed=4)
    outs = []
    for kernel in ("sdpa", "eager"):
        model = loading.load_target_model(llama_dir, attn_implementation=kernel)
        cache = DynamicCache()
        target_forward(model, ids, torch.arange(9)[None], cache)
        outs.append(verify_tree(model, cache, tree, 9))  # (1, N+1, d), (1, N+1, V)
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=0, atol=1e-5)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=0, atol=1e-5)


def test_verification_refuses_flash_attention():
    """A target loaded with flash-attention (stubbed here: no flash-attn, no GPU) cannot take
    the tree mask: verify_tree says so instead of failing inside the kernel."""
    stub = StubTarget(list(range(12)), vocab=16)
    stub.config = SimpleNamespace(**vars(stub.config), _attn_implementation="flash_attention_2")
    with pytest.raises(AssertionError, match="4D additive mask.*sdpa"):
        verify_tree(stub, DynamicCache(), random_tree(3, vocab=16, seed=0), 0)


def test_decoding_through_accelerate_dispatch_hooks(llama_dir, tmp_path):
    """Real values on CPU: a target dispatched by transformers/accelerate with AlignDevicesHook on
    every block (one layer offloaded to disk so dispatch happens; everything executes on CPU)
    gives the plain target's prefill features and the same greedy speculative / vanilla tokens."""
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
                  "model.layers.1": "disk", "model.norm": "cpu", "lm_head": "cpu"}
    hooked = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32, device_map=device_map,
                                                  offload_folder=tmp_path).eval()
    assert hasattr(hooked.model.layers[0], "_hf_hook") and hooked.model.layers[1].mlp.up_proj.weight.is_meta
    plain = loading.load_target_model(llama_dir)
    ids, mask = padded_batch([8, 5], "right", seed=3)
    for got, want in zip(states.target_states(hooked, ids, mask), states.target_states(plain, ids, mask)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    draft = tiny_draft(plain, "beagle")
    prompt = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    for cfg in (DecodeConfig(mode="tree", depth=3, topk=3, total_tokens=8, max_new_tokens=16),
                DecodeConfig(mode="chain", gamma=3, max_new_tokens=16)):
        want = vanilla_generate(plain, prompt, cfg).tokens
        assert vanilla_generate(hooked, prompt, cfg).tokens == want
        assert speculative_generate(hooked, draft, prompt, cfg).tokens == want


def _place(module: torch.nn.Module, device: str) -> None:
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None:
                sub._parameters[name] = torch.nn.Parameter(p.detach().to(device), requires_grad=False)
        for name, b in list(sub._buffers.items()):
            if b is not None:
                sub._buffers[name] = b.to(device)


SPLIT = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
         "model.layers.1": "meta", "model.norm": "meta", "lm_head": "meta"}


@torch.no_grad()
def test_two_device_split_simulated_with_fake_tensors():
    """Simulated (shapes and devices only, no values): a Llama target split over two devices —
    embedding + layer 0 on "cpu", layer 1 + norm + lm_head on "meta" — as fake tensors, with
    accelerate's AlignDevicesHook on each block exactly as dispatch_model attaches them; a
    Beagle and an EAGLE draft live on the output device. Under FakeTensorMode any op that mixes
    the two devices raises, so this checks every device move of the prefill (target_states), the
    target forward with its cache, tree verification, cache compaction and draft start/advance.
    Not simulated: value-dependent steps (acceptance, the speculative loop, the dump's masked
    gathers) — those run on one device in the other tests."""
    from accelerate.hooks import attach_align_device_hook_on_blocks

    model = tiny_target("llama", seed=6)
    drafts = [tiny_draft(model, "beagle"), tiny_draft(model, "eagle")]
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        for name, device in SPLIT.items():
            _place(model.get_submodule(name), device)
        for draft in drafts:
            _place(draft, "meta")
        attach_align_device_hook_on_blocks(model, execution_device={**SPLIT, "": "cpu"},
                                           offload={name: False for name in SPLIT},
                                           skip_keys=model._skip_keys_device_placement)
        with pytest.raises(FakeTensorDeviceMismatchError):  # the simulation does catch a mix
            torch.zeros(2, device="cpu") + torch.zeros(2, device="meta")
    assert placement.input_device(model) == torch.device("cpu")
    assert placement.output_device(model) == torch.device("meta")
    ids, mask = padded_batch([6, 3], "left", seed=7)  # real CPU inputs, as the dump passes them
    with mode:
        hidden, logits = states.target_states(model, ids, mask)
    assert hidden.device.type == logits.device.type == "meta" and logits.shape == (2, 6, 128)
    cache = DynamicCache()
    with mode:
        hidden, logits = target_forward(model, ids[:1], torch.arange(6)[None], cache)
    assert hidden.device.type == "meta" and [layer.keys.device.type for layer in cache.layers] == ["cpu", "meta"]
    tree = random_tree(7, vocab=128, seed=1)  # real tensors (verify_tree reads its depths)
    verified, tree_logits = verify_tree(model, cache, tree, 6)
    assert verified.device.type == tree_logits.device.type == "meta" and cache.get_seq_length() == 13
    with mode:
        compact_cache(cache, 6, [1, 3])
        assert cache.get_seq_length() == 9 and [layer.keys.device.type for layer in cache.layers] == ["cpu", "meta"]
        for draft in drafts:
            ctx = start_draft(draft, ids[:1], hidden, first_token=5)  # ids on cpu, states on meta
            advance_draft(ctx, [4, 2], verified[:, :2])
            assert ctx.cache.view().k.device.type == "meta" and ctx.root_pos == 8


def test_eval_loads_a_mask_kernel_puts_the_draft_at_the_output_and_records_it(tiny_toy_target, tmp_path):
    """Evaluation on CPU with the eager kernel: the draft sits on the target's output device, the
    report's settings carry the requested kernel and the placement actually used; a flash kernel
    is refused for eval (tree verification needs the 4D mask)."""
    from specdraft.configs.evaluation import EvalSettings
    from specdraft.evaluation.models import load_models
    from specdraft.evaluation.run import run_eval
    from specdraft.models import save_draft

    draft_dir = save_draft(tiny_draft(loading.load_target_model(tiny_toy_target), "beagle"), tmp_path / "draft")
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "x", "turns": ["Hello."]}) + "\n")
    settings = EvalSettings(decode=DecodeConfig(mode="tree", depth=2, topk=2, total_tokens=4, max_new_tokens=6),
                            device="cpu", attn_implementation="eager", warmup=False)
    models = load_models(tiny_toy_target, draft_dir, settings)
    assert models.target.config._attn_implementation == "eager"
    assert next(models.draft.parameters()).device == placement.output_device(models.target)
    report = run_eval(tiny_toy_target, draft_dir, [questions], settings, progress=False)
    assert report["settings"]["attn_implementation"] == "eager" and report["settings"]["gpus"] == 1
    assert report["settings"]["placement"] == [{"attn_implementation": "eager", "dtype": "float32",
                                                "devices": ["cpu"], "input_device": "cpu", "output_device": "cpu"}]
    assert report["overall"]["lossless_mismatches"] == 0
    with pytest.raises(AssertionError, match="tree mask"):
        load_models(tiny_toy_target, draft_dir, EvalSettings(attn_implementation="flash_attention_2"))


# --- auxiliary layers (EAGLE-3 features) ------------------------------------------------------


def test_resolve_aux_layers():
    assert resolve_aux_layers(None, 32) == []
    assert resolve_aux_layers("eagle3", 32) == [2, 16, 29]  # states entering layers 2, N/2, N-3
    assert resolve_aux_layers("eagle3", 8) == [2, 4, 5]
    assert resolve_aux_layers([0, 1], 2) == [0, 1]
    assert resolve_aux_layers("eagle3", 7) == [2, 3, 4]  # the shallowest target with three distinct defaults
    # shallower targets: the nearest distinct layers, ties to the deeper ones, with a warning naming them
    for n, nearest in ((6, [2, 3, 4]), (5, [1, 2, 3]), (4, [1, 2, 3]), (3, [0, 1, 2])):
        with pytest.warns(UserWarning, match=rf"N={n}-layer target; using the nearest distinct ones, {re.escape(str(nearest))}"):
            assert resolve_aux_layers("eagle3", n) == nearest
    with pytest.raises(ValueError, match="needs three distinct auxiliary layers.*N=2 layers"):
        resolve_aux_layers("eagle3", 2)
    with pytest.raises(ValueError, match=r"strictly increasing HF hidden_states indices in \[0, 2\)"):
        resolve_aux_layers([0, 2], 2)  # index N is the final normed state: refused
    with pytest.raises(ValueError, match="strictly increasing"):
        resolve_aux_layers([1, 0], 2)
    with pytest.raises(ValueError, match="expected 'eagle3'"):
        resolve_aux_layers("eagle", 32)


@pytest.mark.parametrize("side", ["right", "left"])
def test_dump_aux_features_equal_decodings_target_forward(side):
    """The dump's prefill (``target_features``, padded batch) and decoding's ``target_forward`` (one
    sequence, KV cache) give the same auxiliary features and logits — one capture for both."""
    model = tiny_target("llama", seed=3, num_hidden_layers=4)
    aux = resolve_aux_layers([0, 2, 3], 4)
    ids, mask = padded_batch([9, 4, 6], side)
    hidden, logits, features = states.target_features(model, ids, mask, aux)
    assert features.shape == (3, 9, 3 * TINY["hidden_size"]) and torch.all(features[mask == 0] == 0)
    plain_hidden, plain_logits = states.target_states(model, ids, mask)
    assert torch.equal(plain_hidden, hidden) and torch.equal(plain_logits, logits)
    for row in range(3):
        keep = mask[row].bool()
        n = int(keep.sum())
        feats, lg = target_forward(model, ids[row, keep][None], torch.arange(n)[None], DynamicCache(), aux_layers=aux)
        torch.testing.assert_close(features[row, keep], feats[0], rtol=0, atol=1e-5)
        torch.testing.assert_close(logits[row, keep], lg[0], rtol=0, atol=1e-5)
        embeddings = model.get_input_embeddings()(ids[row, keep])  # (n, d): index 0 = the embeddings
        torch.testing.assert_close(features[row, keep, : TINY["hidden_size"]], embeddings, rtol=0, atol=1e-6)
