"""The toy target: a small Llama chat model built locally to stand in for a served LLM.

``conversations`` (synthetic chats), ``tokenizer`` (byte-level BPE + chat template) and
``build`` (``ToyTargetConfig``, ``build_toy_target``). See docs/first-run.md "What the first run does".
"""
