"""Keeping the draft fresh (docs/operations.md "Keeping the draft fresh"): plain functions over numbers and files,
no MLflow, no Prefect, no torch.

* ``traffic``     a window of dated request logs with replay, its held-out slice and the regression set's
                  earlier slices (reads JSON lines; imports neither torch nor zarr);
* ``record``      ``TrafficRecord``: what the prepare stage keeps of a window (days, counts, warnings, files);
* ``monitor``     the served drift monitor: vLLM's ``/metrics`` read night by night, an alarm on a drop;
* ``retraining``  whether a night trains: drift, or enough new rows;
* ``gate``        the promotion gate: the window's held-out slice and the regression set;
* ``promotion``   the promotion decision: the prompt-lookup floor, the champion, the gate and which measure
                  compares them (the engine's acceptance when measured, else tau) — one pure function;
* ``handoff``     the promoted draft published to ``exports/current``, the previous one kept, rollback.

``pipelines/freshness.py`` feeds these the flow's stages and ``pipelines/registry.py`` does the registry's
MLflow I/O. This ``__init__`` imports nothing, so ``import specdraft.freshness.traffic`` stays light.
"""
