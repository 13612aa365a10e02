"""Serving engines' side of specdraft: the vLLM plugin (``vllm_plugin``, ``vllm_models``) that lets vLLM
serve every draft specdraft trains, and the engine-measured evaluation (``engine``).

The only part of specdraft that imports vLLM, and only lazily: importing this package imports nothing.
"""
