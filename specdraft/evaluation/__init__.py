"""Evaluation of a draft against its target (docs/evaluation.md; τ as in
"EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees", §5): our decoder, the
prompt-lookup floor and the serving engine, on MT-Bench-format question sets.

Modules, bottom up (each imports only those above it, ``specdraft.decoding`` and the core):
* ``questions``         question files -> globally numbered questions; chat-template prompts and answers.
* ``models``            target + draft + tokenizer loaded for evaluation, and their warm-up.
* ``records``           one question, turn by turn: vanilla, speculative and prompt-lookup decoding -> records.
* ``baselines``         vanilla's tokens and the floor's counts of a question set, kept on disk (never times).
* ``replicas``          questions spread over worker processes.
* ``report``            records -> per-dataset / per-turn report, written whole.
* ``run``               ``run_eval``: questions, cache, workers and report in one call.
* ``engine_records``    what crosses between the driver and the engine process.
* ``engine_process``    the vLLM child process (``python -m specdraft.evaluation.engine_process``).
* ``engine_comparison`` our decoder on the engine's prompts, counted as vLLM counts.
* ``engine``            ``engine_report``: export, serve, compare; ``engine_summary``.

Settings: ``specdraft.configs.evaluation.EvalSettings`` and ``specdraft.configs.evaluation.EngineSettings``. Importing
this package imports nothing; only ``engine_process`` imports vLLM.
"""
