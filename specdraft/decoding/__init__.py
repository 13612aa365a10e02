"""Speculative decoding with Beagle / EAGLE drafts: chains and EAGLE-2 dynamic trees ("EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees" §4).

Modules, bottom up:
* ``sampling``    token choice shared by vanilla and speculative decoding (warpers, RNG).
* ``cache``       the target's preallocated KV cache (commit by index) and verification mask buffer.
* ``drafting``    the draft's cache of true states and its tree-attention queries.
* ``tree``        EAGLE-2 dynamic draft trees, chains, tree mask and position ids.
* ``verify``      one-forward target verification, acceptance (one host read), cache commit.
* ``speculative`` the one generation loop ``speculative_decode`` over a ``Drafter`` seam,
                  ``speculative_generate`` (draft model) / ``vanilla_generate`` (batch 1).
* ``prompt_lookup`` training-free prompt-lookup drafting (n-gram copy), the evaluation floor.
* ``metrics``     τ, α_i, tokens/s, speedup, lossless counts.
* ``eval``        the evaluation's settings (``EvalSettings``; the evaluation itself: ``specdraft.evaluation``).
"""

from specdraft.decoding.prompt_lookup import prompt_lookup_generate
from specdraft.decoding.speculative import (
    Drafter,
    Generation,
    ModelDrafter,
    eos_token_ids,
    speculative_decode,
    speculative_generate,
    vanilla_generate,
)
from specdraft.decoding.tree import DraftTree, build_draft_chain, build_draft_tree, tree_attention_mask

__all__ = [
    "DraftTree",
    "Drafter",
    "Generation",
    "ModelDrafter",
    "build_draft_chain",
    "build_draft_tree",
    "eos_token_ids",
    "prompt_lookup_generate",
    "speculative_decode",
    "speculative_generate",
    "tree_attention_mask",
    "vanilla_generate",
]
