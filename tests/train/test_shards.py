"""gti/train/shards.py: padding token-id rows into batches, and the resumable, length-grouped
stream of micro-batches over a (fake) data shard."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gti.train.shards import PadCollate


def test_pad_collate_right_pads_and_masks():
    batch = {
        "input_ids": np.array([np.array([5, 6, 7]), np.array([8])], dtype=object),
        "labels": np.array([np.array([-100, 6, 7]), np.array([8])], dtype=object),
    }
    out = PadCollate(pad_id=0)(batch)
    assert out["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert out["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert out["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert out["input_ids"].dtype == torch.long


def test_pad_collate_rejects_length_mismatch():
    from gti.common.errors import DataError

    batch = {"input_ids": [[1, 2]], "labels": [[1]]}
    with pytest.raises(DataError, match="row 0"):
        PadCollate(0)(batch)


class _FakeShard:
    """Stands in for a Ray Data shard: the same ordered rows every epoch, read in chunks."""

    def __init__(self, n: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.rows = [list(range(100 * i, 100 * i + int(rng.integers(3, 40)))) for i in range(n)]

    def iter_batches(self, batch_size, batch_format, prefetch_batches):
        assert batch_format == "numpy"
        for i in range(0, len(self.rows), batch_size):
            chunk = self.rows[i: i + batch_size]
            ids = np.empty(len(chunk), dtype=object)
            ids[:] = [np.asarray(r) for r in chunk]
            yield {"input_ids": ids, "labels": ids.copy()}


def _epoch_rows(stream, n_batches):
    from itertools import islice

    out = []
    for b in islice(iter(stream), n_batches):
        first_ids = b["input_ids"][:, 0].tolist()
        out.append([i // 100 for i in first_ids])
    return out


def test_length_grouped_stream_every_row_once_deterministic_and_resumable():
    from gti.train.shards import PadCollate, ShardStream

    shard, micro = _FakeShard(203), 4
    n_batches = -(-203 // micro) + 3  # the whole first epoch and the start of the second
    # Chunks of WINDOW micro-batches; only the epoch's last batch may be short.
    a = _epoch_rows(ShardStream(shard, micro, PadCollate(0), seed=5, group_by_length=True), n_batches)
    b = _epoch_rows(ShardStream(shard, micro, PadCollate(0), seed=5, group_by_length=True), n_batches)
    assert a == b
    epoch1 = [r for batch in a[: n_batches - 3] for r in batch]
    assert sorted(epoch1) == list(range(203))
    assert sum(len(x) < micro for x in a[: n_batches - 3]) == 1
    # The next epoch has another order (seeded by epoch).
    assert a[n_batches - 3:] != a[:3]
    # Grouping: rows in a batch are much closer in length than random batches.
    lens = [len(r) for r in shard.rows]
    spread = np.mean([max(lens[i] for i in x) - min(lens[i] for i in x) for x in a[: n_batches - 3]])
    assert spread < 8  # lengths span 3..39; random batches of 4 spread ~20
    # Resuming at (epoch 0, offset 10) gives exactly the rest of the same stream.
    resumed = _epoch_rows(ShardStream(shard, micro, PadCollate(0), seed=5, epoch=0, offset=10,
                                      group_by_length=True), n_batches - 10)
    assert resumed == a[10:]
    other = _epoch_rows(ShardStream(shard, micro, PadCollate(0), seed=6, group_by_length=True), n_batches)
    assert other != a
