"""Serving engines' side of specdraft: the vLLM plugin (``vllm_plugin``, ``vllm_models``) that lets vLLM
serve every draft specdraft trains, and the engine measurement's settings (``engine``; the measurement
itself is ``specdraft.evaluation.engine``).

With ``specdraft.evaluation.engine_process``, the only part of specdraft that imports vLLM, and only
lazily: importing this package imports nothing.
"""
