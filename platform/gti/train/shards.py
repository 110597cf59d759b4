"""The training loop's batch plumbing: token-id rows -> padded tensors, and an endless,
resumable stream of micro-batches over a worker's data shard.

What it is for: `PadCollate` (rows {"input_ids", "labels"} -> right-padded LongTensors
input_ids / labels / attention_mask [B, T]) and `ShardStream` (micro-batches epoch after
epoch, knowing its position so a resumed run skips exactly the consumed batches;
length-grouped through `gti.train.batching.length_grouped_batches` when asked). The shard is
duck-typed (`iter_torch_batches` / `iter_batches` of a Ray Data shard), so this module never
imports Ray.

What it does not know: models, tokenizers, or which task the rows belong to.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch

from gti.common.errors import DataError
from gti.train.batching import length_grouped_batches

IGNORE_INDEX = -100


class PadCollate:
    """collate_fn for `iter_torch_batches`: {"input_ids": [B] lists, "labels": [B] lists} ->
    LongTensors input_ids / labels / attention_mask [B, T], right-padded to the longest row."""

    def __init__(self, pad_id: int) -> None:
        self.pad_id = int(pad_id)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        ids = [np.asarray(x, dtype=np.int64) for x in batch["input_ids"]]
        labels = [np.asarray(x, dtype=np.int64) for x in batch["labels"]]
        t = max(len(x) for x in ids)
        b = len(ids)
        out_ids = np.full((b, t), self.pad_id, dtype=np.int64)
        out_lab = np.full((b, t), IGNORE_INDEX, dtype=np.int64)
        mask = np.zeros((b, t), dtype=np.int64)
        for i, (x, y) in enumerate(zip(ids, labels)):
            if len(x) != len(y):
                raise DataError(f"training row {i} of a batch: input_ids and labels differ in length")
            out_ids[i, : len(x)] = x
            out_lab[i, : len(y)] = y
            mask[i, : len(x)] = 1
        return {
            "input_ids": torch.from_numpy(out_ids),
            "labels": torch.from_numpy(out_lab),
            "attention_mask": torch.from_numpy(mask),
        }


class ShardStream:
    """Endless iterator of micro-batches over a Ray Data shard, epoch after epoch, that knows
    its position (epoch, micro-batches consumed in it) and can start from one.

    Every epoch is the same seeded order, so skipping `offset` batches reproduces the
    position exactly. With `group_by_length` the shard is read in chunks of `window` micro-
    batches' worth of rows and each chunk is cut into micro-batches of similar length
    (`gti.train.batching.length_grouped_batches`, seeded by seed, epoch and chunk), so padding
    costs little; each row appears exactly once per epoch and the epoch's last micro-batch may
    be short. Without it, a seeded local shuffle buffer and full micro-batches only.
    Raises DataError if an epoch has no micro-batch.
    """

    WINDOW = 32  # micro-batches per length-grouping chunk

    def __init__(self, shard: Any, micro: int, collate: PadCollate, seed: int,
                 epoch: int = 0, offset: int = 0, group_by_length: bool = False) -> None:
        self.shard, self.micro, self.collate, self.seed = shard, micro, collate, seed
        self.epoch, self.offset = epoch, offset
        self.group_by_length = group_by_length
        # A few batches of local shuffle give each epoch a different order at no memory cost.
        self.buffer = max(64, 8 * micro)

    def _epoch_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        if not self.group_by_length:
            yield from self.shard.iter_torch_batches(
                batch_size=self.micro,
                collate_fn=self.collate,
                drop_last=True,
                local_shuffle_buffer_size=self.buffer,
                local_shuffle_seed=self.seed + self.epoch,
                prefetch_batches=1,
            )
            return
        chunks = self.shard.iter_batches(
            batch_size=self.micro * self.WINDOW, batch_format="numpy", prefetch_batches=1,
        )
        for c, chunk in enumerate(chunks):
            ids, labels = chunk["input_ids"], chunk["labels"]
            lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
            seed = int(np.random.SeedSequence([self.seed, self.epoch, c]).generate_state(1)[0])
            for idx in length_grouped_batches(lengths, self.micro, seed, window=self.WINDOW):
                yield self.collate({"input_ids": [ids[i] for i in idx], "labels": [labels[i] for i in idx]})

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            n = 0
            for i, batch in enumerate(self._epoch_batches()):
                n += 1
                if i < self.offset:
                    continue
                self.offset = i + 1
                yield batch
            if n == 0:
                raise DataError(
                    f"a training worker's data shard has no full micro-batch of {self.micro} rows"
                )
            self.epoch, self.offset = self.epoch + 1, 0
