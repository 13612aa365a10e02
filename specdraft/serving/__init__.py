"""Serving engines run for real: the drafts exported by ``specdraft.export`` loaded and decoded by vLLM
("Efficient Memory Management for Large Language Model Serving with PagedAttention" (vLLM), §4), so
what an engine accepts is measured, not assumed. The only place specdraft imports vllm.
"""
