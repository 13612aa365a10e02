"""Serving engines' side of specdraft: the vLLM plugin (``vllm_plugin``: the entry point vLLM calls, registering
the draft architectures it lacks) and the model classes it registers (``vllm_models``), so that vLLM serves every
draft specdraft trains and exports (``specdraft export --format vllm``). The engine measurement's settings are
``specdraft.configs.evaluation.EngineSettings``; the measurement itself is ``specdraft.evaluation.engine``.

``vllm_models`` and ``specdraft.evaluation.engine_process`` are the parts of specdraft that import vLLM, and
only when vLLM loads them or a measurement starts: importing this package imports nothing.
"""
