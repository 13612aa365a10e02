"""specdraft's drafts as vLLM draft models, for the EAGLE proposer of vLLM 0.32 (``method: "eagle"`` /
``"eagle3"``). Imported by vLLM only, through ``vllm_plugin.register`` (lazily, by name).

vLLM's EAGLE pairing: draft position i carries token t_{i+1} and the target's state h_i (or, at later
draft steps, the draft's own state returned by the step before); the draft's attention is causal over
its own KV cache; ``forward`` returns (states for the logits, states fed to the next step).

* ``SpecdraftEagleForCausalLM`` — EAGLE-1/2 (the HASS base: "Learning Harmonized Representations for
  Speculative Sampling" §2): vLLM's own ``EagleLlamaForCausalLM`` with the fc bias the EAGLE reference,
  SGLang and specdraft's ``EagleDraft`` have and vLLM's class lacks (it drops ``fc.bias`` silently).
* ``SpecdraftBeagleForCausalLM`` — Beagle ("Cross-Attention Speculative Decoding" §4.1, Eq. 1-2): no
  self-attention over fused slots; the query at position i is norm(e(t_{i+1})) at RoPE position i+1,
  the key/value at position i is norm(h_i) at RoPE position i, so vLLM's causal mask (keys j <= i) is
  exactly Beagle's strict mask (the token t_{i+1} sees states j < i+1); the drafted state returned for
  position i becomes the key/value of position i+1's step, Beagle drafting with its drafted states
  appended ("concate").
* ``SpecdraftBeagle3ForCausalLM`` — Beagle over the EAGLE-3 features (recipe ``beagle3``): the same
  block, true states fc(cat(aux states)) (vLLM's ``combine_hidden_states``), a final norm and a
  draft-vocabulary lm_head with ``d2t`` (vLLM's EAGLE-3 logits path, which it subclasses because the
  EAGLE-3 proposer accepts only its own classes).

Checkpoint names (written by ``specdraft.export`` format ``vllm``): ``layers.0.self_attn.{q,k,v,o}_proj``,
``layers.0.{query_norm,state_norm,post_attention_layernorm}``, ``layers.0.mlp.{gate,up,down}_proj``,
``fc`` (beagle3, and EAGLE's fc with its bias), ``norm``, ``lm_head``, ``d2t``. No embedding and, for
full-vocabulary drafts, no lm_head: vLLM shares the target's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.llama import LlamaAttention, LlamaMLP
from vllm.model_executor.models.llama_eagle import EagleLlamaForCausalLM
from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper, maybe_prefix, process_eagle_weight

STACKED = {  # checkpoint projection -> (vLLM fused parameter, shard)
    ".q_proj": (".qkv_proj", "q"),
    ".k_proj": (".qkv_proj", "k"),
    ".v_proj": (".qkv_proj", "v"),
    ".gate_proj": (".gate_up_proj", 0),
    ".up_proj": (".gate_up_proj", 1),
}


class SpecdraftEagleForCausalLM(EagleLlamaForCausalLM):
    """vLLM's EAGLE-1 draft with the fc bias of the EAGLE reference layout."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        d = self.config.hidden_size
        self.model.fc = ReplicatedLinear(
            input_size=2 * d,
            output_size=d,
            bias=True,
            params_dtype=vllm_config.model_config.dtype,
            prefix=maybe_prefix(maybe_prefix(prefix, "model"), "fc"),
            return_bias=False,
        )


class BeagleAttention(LlamaAttention):
    """Cross-attention: queries from the token side, keys/values from the state side. The one fused qkv
    projection runs on both sides at once (its q rows of the states and k/v rows of the tokens are dropped):
    the engine's own linear layer, so tensor parallelism, weight packing and quantization work as for Llama."""

    def forward(self, positions: torch.Tensor, queries: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
        n = queries.shape[0]
        qkv, _ = self.qkv_proj(torch.cat([queries, states], dim=0))  # (2N, q + 2 kv) on this rank
        q = qkv[:n, : self.q_size]  # (N, H*Dh)
        k, v = qkv[n:, self.q_size :].split([self.kv_size, self.kv_size], dim=-1)  # (N, Hkv*Dh)
        # the token t_{i+1} sits at RoPE position i+1, the state h_i at i (the native rotation takes a query alone)
        q, _ = self.rotary_emb.forward_native(positions + 1, q, None)
        k, _ = self.rotary_emb.forward_native(positions, k, None)
        output, _ = self.o_proj(self.attn(q, k, v))
        return output  # (N, d)


class BeagleModel(nn.Module):
    """The Beagle block over vLLM's EAGLE inputs (token ids, states, positions)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", start_layer_id: int = 0, aux: bool = False):
        super().__init__()
        config = vllm_config.speculative_config.draft_model_config.hf_config
        self.config = config
        d = config.hidden_size
        layer = maybe_prefix(prefix, f"layers.{start_layer_id}")
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, d, prefix=maybe_prefix(prefix, "embed_tokens"))
        self.query_norm = RMSNorm(d, eps=config.rms_norm_eps)
        self.state_norm = RMSNorm(d, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, eps=config.rms_norm_eps)
        self.self_attn = BeagleAttention(
            config=config,
            hidden_size=d,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            # the query's RoPE position runs one ahead of the keys' (max_model_len + 1 at the last token)
            max_position_embeddings=config.max_position_embeddings + 1,
            cache_config=vllm_config.cache_config,
            prefix=maybe_prefix(layer, "self_attn"),
        )
        self.mlp = LlamaMLP(d, config.intermediate_size, "silu", prefix=maybe_prefix(layer, "mlp"))
        # the EAGLE-3 side that vLLM's Eagle3LlamaForCausalLM.combine_hidden_states and compute_logits read
        self.use_aux_hidden_state = aux
        self.norm_before_fc, self.input_norm, self.fc_norm = False, None, None
        if aux:
            self.num_aux_hidden_states = len(aux_layer_ids(config))
            self.fc_input_size = getattr(config, "target_hidden_size", d) * self.num_aux_hidden_states
            self.fc = ReplicatedLinear(
                self.fc_input_size,
                d,
                bias=False,
                params_dtype=vllm_config.model_config.dtype,
                prefix=maybe_prefix(prefix, "fc"),
                return_bias=False,
            )
            self.norm = RMSNorm(d, eps=config.rms_norm_eps)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # (N, d)
        y = e + self.self_attn(positions, self.query_norm(e), self.state_norm(hidden_states))  # (N, d)
        h = y + self.mlp(self.post_attention_layernorm(y))  # (N, d): the predicted state
        return (self.norm(h) if self.use_aux_hidden_state else h), h

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        mapper = WeightsMapper(orig_to_new_prefix={"layers.0.": ""}, orig_to_new_stacked=STACKED)
        return AutoWeightsLoader(self).load_weights(weights, mapper=mapper)


def aux_layer_ids(config) -> list[int]:
    ids = getattr(config, "eagle_aux_hidden_state_layer_ids", None)
    if ids is None:
        ids = (getattr(config, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
    assert ids, "a beagle3 draft config names its auxiliary target layers (eagle_aux_hidden_state_layer_ids)"
    return list(ids)


class SpecdraftBeagleForCausalLM(EagleLlamaForCausalLM):
    """Beagle over the target's last hidden state, with the target's embedding and lm_head (method "eagle")."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        nn.Module.__init__(self)
        self.config = vllm_config.speculative_config.draft_model_config.hf_config
        if getattr(self.config, "draft_vocab_size", None) is None:
            self.config.draft_vocab_size = self.config.vocab_size
        target_layers = vllm_config.model_config.get_num_layers(vllm_config.parallel_config)
        self.model = BeagleModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"),
                                 start_layer_id=target_layers)
        self.logits_processor = LogitsProcessor(self.config.vocab_size, scale=getattr(self.config, "logit_scale", 1.0))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        def named(items):
            for name, tensor in items:
                process_eagle_weight(self, name)
                yield name, tensor

        self.model.load_weights(named(weights))


class SpecdraftBeagle3ForCausalLM(Eagle3LlamaForCausalLM):
    """Beagle over the EAGLE-3 features with a draft vocabulary (method "eagle3")."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        nn.Module.__init__(self)
        speculative = vllm_config.speculative_config
        self.config = speculative.draft_model_config.hf_config
        if getattr(self.config, "draft_vocab_size", None) is None:
            self.config.draft_vocab_size = self.config.vocab_size
        target_layers = vllm_config.model_config.get_total_num_hidden_layers()
        self.config.target_layer_count = target_layers
        self.model = BeagleModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"),
                                 start_layer_id=target_layers, aux=True)
        self.lm_head = ParallelLMHead(self.config.draft_vocab_size, self.config.hidden_size,
                                      prefix=maybe_prefix(prefix, "lm_head"))
        self.logits_processor = LogitsProcessor(self.config.draft_vocab_size,
                                                scale=getattr(self.config, "logit_scale", 1.0))
        if self.config.draft_vocab_size != vllm_config.model_config.get_vocab_size():
            self.draft_id_to_target_id = nn.Parameter(
                torch.zeros(self.config.draft_vocab_size, dtype=torch.long), requires_grad=False
            )
        else:
            self.draft_id_to_target_id = None
        self.use_parallel_drafting = False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        model_weights = []
        for name, tensor in weights:
            process_eagle_weight(self, name)
            if name == "t2d":
                continue
            if name == "d2t":
                assert self.draft_id_to_target_id is not None, (
                    "d2t given for a draft over the target's whole vocabulary"
                )
                self.draft_id_to_target_id.data.copy_(tensor)
            elif name == "lm_head.weight":
                self.lm_head.weight_loader(self.lm_head.weight, tensor)
            else:
                model_weights.append((name, tensor))
        self.model.load_weights(model_weights)
