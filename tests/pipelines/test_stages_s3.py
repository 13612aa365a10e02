"""The run's feature stores at ``store_root`` (``pipelines.stages.dump_file`` and ``store_location``), against a real
S3 server (moto's server mode on 127.0.0.1): the dump writes the store at ``<store_root>/<key>`` on S3 and the
stage's ``DONE`` record in the workdir; the key, the shards and the manifest are those of the same dump into the
workdir; a rerun skips it; an unfinished stage resumes at the URL, keeping the complete shards; training reads it
there."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import fsspec
import pytest

from pipelines.configs import ClusterTrainConfig, DumpConfig, RunConfig, ScalingSection
from pipelines.conversations import write_conversations
from pipelines.records import Prepared, Regenerated
from pipelines.stages import dump_file, train
from specdraft import store
from specdraft.configs.reader import ReaderConfig
from specdraft.targets.identity import target_id
from specdraft.toy.conversations import generate_conversations

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

SHARD_FACTS = ("index", "num_sequences", "num_tokens", "num_loss_tokens", "checksums")  # not where or when


def shards(url_or_dir: str) -> list[dict]:
    """The manifest's shard records, less where and when each was written."""
    return [{k: r[k] for k in SHARD_FACTS} for r in store.read_manifest(url_or_dir)["shards"]]


def test_the_dump_writes_the_runs_store_under_store_root_on_s3_and_resumes_there(s3_ray, s3_bucket, tiny_toy_target,
                                                                                 tmp_path):
    rows = [{"id": f"c{i}", "source": "t", "messages": m} for i, m in enumerate(generate_conversations(20, seed=3))]
    write_conversations(tmp_path / "regenerate" / "k" / "part-00000.parquet", rows)
    regenerated = Regenerated(key="k", prompt="t.jsonl", conversations=str(tmp_path / "regenerate" / "k"),
                              summary={}, wall_s=0.0)
    prepared = Prepared(target=str(tiny_toy_target), target_id=target_id(tiny_toy_target), prompts=[], wall_s=0.0)
    cfg = RunConfig(workdir=str(tmp_path / "runs"), store_root=f"{s3_bucket}/stores/",  # a trailing slash: the same
                    features=DumpConfig(max_length=80, samples_per_shard=8, aux_layers=[0, 1]),
                    train=ClusterTrainConfig(recipe="beagle-early", epochs=[1], min_steps=1, checkpoint_every=0,
                                             val_max_batches=1, reader=ReaderConfig(max_tokens=512, val_fraction=0.2),
                                             scaling=ScalingSection(num_workers=0)))  # Ray Train's local mode

    dumped = dump_file(cfg, prepared, regenerated)
    local = dump_file(replace(cfg, workdir=str(tmp_path / "local"), store_root=""), prepared, regenerated)
    assert dumped.key == local.key  # where the store lives is no input of the stage's key
    assert dumped.store == f"{s3_bucket}/stores/{dumped.key}"
    assert local.store == str(tmp_path / "local" / "features" / local.key)  # no store_root: the workdir, as before
    stage_dir = tmp_path / "runs" / "features" / dumped.key
    assert [p.name for p in stage_dir.iterdir()] == ["DONE"]  # the workdir holds the record, nothing of the store
    assert json.loads((stage_dir / "DONE").read_text())["store"] == dumped.store
    report = store.validate(dumped.store)
    n = dumped.summary["shards"]
    assert report.ok and report.num_shards == n == dumped.summary["shards_written"] >= 3, (report, dumped.summary)
    assert shards(dumped.store) == shards(local.store)  # the same arrays, sequences and tokens

    again = dump_file(cfg, prepared, regenerated)  # finished: read back from its DONE record
    assert again.skipped and again.store == dumped.store and again.summary == dumped.summary

    # the stage unfinished (no DONE) and its store cut short (no manifest, shard 1 gone): the rerun resumes at the
    # URL, keeping the other shards and writing shard 1 again — the store of the uninterrupted dump
    s3 = fsspec.filesystem("s3", skip_instance_cache=True)
    (stage_dir / "DONE").unlink()
    s3.rm(f"{dumped.store}/{store.MANIFEST_FILE}")
    s3.rm(f"{dumped.store}/{store.shard_name(1)}", recursive=True)
    with pytest.raises(store.StoreError):
        store.FeatureDataset(dumped.store)
    resumed = dump_file(cfg, prepared, regenerated)
    assert not resumed.skipped and resumed.store == dumped.store
    assert resumed.summary["shards_kept"] == n - 1 and resumed.summary["shards_written"] == 1, resumed.summary
    assert shards(resumed.store) == shards(local.store) and store.validate(resumed.store).ok

    trained = train(cfg, prepared, [resumed])  # in this process, reading the store on S3
    assert (Path(trained.draft) / "model.safetensors").is_file()
    assert trained.metrics and not list((tmp_path / "runs").glob("**/shard-*"))  # no shard in the workdir
