"""Every core settings dataclass, in one light place (Lightning-AI/litgpt ``args.py``; pytorch/torchtitan
``config/job_config.py``): importing it loads no torch, Ray or Zarr, so ``--help`` and validation read the
classes themselves. Values are checked when a class is built: a bad one is a ``specdraft.config.ConfigError``
naming its key. Loading from YAML and ``key=value`` is ``specdraft.config``; the Ray side's settings (actors,
workers, GPUs, checkpoints) are ``pipelines/configs.py``.

* ``stages``: ``StageConfig``, ``LossWeights`` — a training stage and its losses;
* ``recipes``: ``RECIPES`` — the recipe table (pure data: each recipe's draft, features and stage schedule);
* ``train``: ``TrainConfig``, ``OptimConfig`` — the ``train`` section (recipe, optimizer, reader, draft shape);
* ``features``: ``FeaturesConfig`` — what a feature store holds and how a prefill computes it;
* ``reader``: ``ReaderConfig`` — how a store is batched;
* ``draft``: ``DraftConfig`` — a draft's geometry (its ``config.json``);
* ``decode``: ``SamplingConfig``, ``DecodeConfig``, ``PromptLookupConfig`` — decoding;
* ``evaluation``: ``EvalSettings``, ``EngineSettings`` — evaluation and the serving engine's measurement;
* ``export``: ``ExportConfig`` — an export for a serving engine;
* ``toy``: ``ToyTargetConfig`` — the toy target build; ``quickstart``: ``QuickstartConfig``;
* ``devices``: the attention kernels and GPUs-per-actor a setting may name;
* ``fresh``: ``TrafficSettings``, ``MonitorSettings``, ``GateSettings``, ``HandoffSettings``, ``RetrainSettings`` — keeping a
  served draft fresh.

Import the classes from their modules (``from specdraft.configs.train import TrainConfig``), the one address of
each: this package runs nothing. The settings are the bottom floor: they import ``specdraft.config`` (its
``ConfigError``) and each other, nothing else of specdraft (``tests/test_dependency_rule.py``).
"""
