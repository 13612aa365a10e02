"""What a resumed dump must leave: the store an uninterrupted dump writes (docs/guarantees.md, the dump).

A dump stopped part-way (its writer killed on one node, a Ray node lost on a cluster, a writer dead on an object
store) and run again keeps the shards complete before the stop — not rewritten —, writes every sample once and
ends with the same arrays as a dump never stopped. ``complete_shards`` says which shards were complete at the
stop (and how to tell one was not rewritten); ``assert_resumed_like`` checks the resumed store against the
reference dump. Shared by ``tests/pipelines/test_dump.py`` (one node, a directory and S3) and
``tests/faults/test_node_loss.py`` (a cluster).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from specdraft import store

SUMMED = ("rows_out", "tokens", "rejected")  # what the resumed dump's summary says as the reference's did


def complete_shards(out: Path | str) -> dict[int, Any]:
    """Shard index -> a stamp that changes when the shard is rewritten, for every complete shard of ``out``: a
    directory's final shards (complete by their rename) and their inode; at an object-store URL (written in
    place) the shards whose record was written, and the record's ``written_at``."""
    finals, _ = store.list_shard_dirs(out)
    if not store.location.is_url(out):
        return {i: Path(p).stat().st_ino for i, p in finals.items()}
    stamps = {}
    for index, shard in finals.items():
        try:
            stamps[index] = store.read_shard_record(shard)["written_at"]
        except store.StoreError:  # a writer's keys without its record: not complete
            pass
    return stamps


def per_sample(out: Path | str) -> dict[str, dict[str, np.ndarray]]:
    """Sample id -> its arrays, read shard by shard from the manifest (a sample in two shards fails)."""
    samples = {}
    for record in store.read_manifest(out)["shards"]:
        group = store.location.open_group(store.location.join(out, record["name"]), "r")
        arrays = {name: a[...] for name, a in group.arrays()}
        off = arrays["offsets"]
        for j, sid in enumerate(arrays["sample_ids"].tolist()):
            assert sid not in samples, f"{sid} written twice"
            samples[sid] = {k: v[off[j] : off[j + 1]] for k, v in arrays.items() if k not in ("offsets", "sample_ids")}
    return samples


def assert_resumed_like(out: Path | str, summary: dict[str, Any], reference_dir: Path | str,
                        reference: dict[str, Any], kept: dict[int, Any]) -> None:
    """The resumed dump of ``out`` (its ``summary``) is the reference dump (``reference_dir``, its summary
    ``reference``): the shards complete before the stop (``kept``: ``complete_shards`` then) kept and not
    rewritten, every shard final with no temporary left, the same counts, every sample once, the same arrays."""
    shards = reference["shards"]
    assert summary["shards_kept"] + summary["shards_written"] == shards  # (a dump that went on kept none itself)
    assert {k: summary[k] for k in SUMMED} == {k: reference[k] for k in SUMMED}
    after, temps = store.list_shard_dirs(out)
    assert sorted(after) == list(range(shards)) and temps == []
    now = complete_shards(out)
    assert {i: now.get(i) for i in kept} == kept  # kept, not rewritten
    assert store.validate(out).ok
    got, want = per_sample(out), per_sample(reference_dir)
    assert sorted(got) == sorted(want)  # no duplicates, no gaps
    for sid in want:
        for name in want[sid]:
            np.testing.assert_array_equal(got[sid][name], want[sid][name], err_msg=f"{sid}/{name}")
