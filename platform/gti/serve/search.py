"""Catalog search for `GET /items`: a compact index and a top-k that never sorts every hit.

What it is for: `CatalogIndex.build(item_ids, titles)` holds, per loaded run, ONE bytes object of
every item's lowercased key instead of a Python tuple of two lowercased strings per item
(several times the memory, and GC-tracked objects per item, at the 1M-10M catalogs `gti serve`
targets). `search(text, limit)` returns the rows of up to `limit` items whose key contains the
text: the item with that id first, then keys starting with the text, then catalog order, in
O(limit) Python steps however many items match.

What it does NOT know: HTTP, models, what a SID is.
"""

from __future__ import annotations

import heapq
from typing import Iterator, Mapping, Sequence

import numpy as np

SEP = b"\x00"
_CHUNK = 65536  # keys joined per piece while building: bounds the build's transient list


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


class CatalogIndex:
    """The lowercased keys of a catalog in one buffer: every item's key,
    `f"{title}\\n{item_id}".lower()` in UTF-8, between NUL separators; one int64 array of where
    each key starts; and the lowercased ids' hashes sorted (with their rows).

    `search(text, limit)` ranks as `sorted((item_id.lower() != needle, not
    key.startswith(needle), row))[:limit]` with needle = `text.strip().lower()`: the same rows,
    ties included, as that full sort, which it replaced:
    - the item with that id: a binary search of the ids' hashes, each candidate checked;
    - the other matches come from `bytes.find` (C), one key at a time in row order, so each rank
      is met in row order and its scan stops after `limit` rows: a search costs O(limit) Python
      steps however many items match (the page searches the empty text on load), and at most
      two passes of `find` over the buffer;
    - the candidates of the three ranks (at most a few x `limit`) are merged by `heapq.nsmallest`.
    Substring tests on UTF-8 bytes agree with those on the text (UTF-8 is self-synchronising;
    "surrogatepass" keeps even unpaired surrogates one code point to one byte sequence), and
    every hit is checked to lie within one key, so a NUL or newline in a title or in the text
    changes nothing.
    """

    def __init__(self, item_ids: Sequence[str], text: bytes, starts: np.ndarray) -> None:
        self.item_ids, self.text, self.starts = item_ids, text, starts
        # hash() of a str is fixed within a process, and the index never leaves its process
        hashes = np.fromiter((hash(i.lower()) for i in item_ids), dtype=np.int64, count=len(item_ids))
        self.id_rows = np.argsort(hashes, kind="stable")
        self.id_hashes = hashes[self.id_rows]

    @classmethod
    def build(cls, item_ids: Sequence[str], titles: Mapping[str, str]) -> "CatalogIndex":
        pieces, starts, pos = [SEP], np.empty(len(item_ids) + 1, dtype=np.int64), 1
        for lo in range(0, len(item_ids), _CHUNK):
            keys = [_utf8(f"{titles.get(i, '')}\n{i}".lower()) for i in item_ids[lo:lo + _CHUNK]]
            steps = np.fromiter(map(len, keys), dtype=np.int64, count=len(keys)) + 1  # the key and its separator
            ends = pos + np.cumsum(steps)
            starts[lo:lo + len(keys)] = ends - steps
            pos = int(ends[-1])
            pieces.append(SEP.join(keys) + SEP)
        starts[len(item_ids)] = pos  # one past the last key's separator: key r ends at starts[r + 1] - 1
        return cls(item_ids, b"".join(pieces), starts)

    def __len__(self) -> int:
        return len(self.item_ids)

    @property
    def nbytes(self) -> int:
        return len(self.text) + self.starts.nbytes + self.id_rows.nbytes + self.id_hashes.nbytes

    # ------------------------------------------------------------------ scans
    def _row_at(self, pos: int) -> int:
        """The key holding byte `pos` (-1 before the first key)."""
        return int(np.searchsorted(self.starts, pos, side="right")) - 1

    def _within(self, row: int, pos: int, n: int) -> bool:
        return 0 <= row < len(self) and self.starts[row] <= pos and pos + n <= self.starts[row + 1] - 1

    def _containing(self, needle: bytes) -> Iterator[int]:
        """Rows whose key contains `needle`, in row order, each once."""
        text, n, pos = self.text, len(needle), 0
        while (hit := text.find(needle, pos)) >= 0:
            row = self._row_at(hit)
            if self._within(row, hit, n):
                yield row
                pos = int(self.starts[row + 1])  # the next key: one hit per row is enough
            else:  # a hit across a separator: the next key may still hold it
                pos = hit + 1

    def _starting(self, needle: bytes) -> Iterator[int]:
        """Rows whose key starts with `needle`, in row order."""
        text, n, pos = self.text, len(needle), 0
        while (hit := text.find(SEP + needle, pos)) >= 0:
            row = self._row_at(hit + 1)
            if self._within(row, hit + 1, n) and self.starts[row] == hit + 1:
                yield row
                pos = int(self.starts[row + 1]) - 1  # the separator before the next key
            else:
                pos = hit + 1

    def _with_id(self, needle: str) -> list[int]:
        """Rows whose item id, lowercased, is `needle`, in row order."""
        h = hash(needle)
        lo, hi = np.searchsorted(self.id_hashes, h, "left"), np.searchsorted(self.id_hashes, h, "right")
        return sorted(int(r) for r in self.id_rows[lo:hi] if self.item_ids[int(r)].lower() == needle)

    # ------------------------------------------------------------------ search
    def search(self, text: str, limit: int) -> list[int]:
        """Rows of up to `limit` items matching `text`, best first (see the module docstring)."""
        if limit < 1:
            return []
        needle = text.strip().lower()
        raw = _utf8(needle)
        first = self._with_id(needle)
        by_id = set(first)

        def take(rows: Iterator[int], skip, n: int) -> list[int]:
            out = []
            for row in rows:
                if len(out) >= n:
                    break
                if not skip(row):
                    out.append(row)
            return out

        starting = take(self._starting(raw), by_id.__contains__, limit)
        rest: list[int] = []
        if len(by_id) + len(starting) < limit:  # only then can a row of the third rank make the cut
            seen = by_id.union(starting)
            rest = take(self._containing(raw), lambda r: r in seen or self._starts_with(r, raw), limit)
        cands = {(row not in by_id, not self._starts_with(row, raw), row) for row in [*first, *starting, *rest]}
        return [row for *_, row in heapq.nsmallest(limit, cands)]

    def _starts_with(self, row: int, needle: bytes) -> bool:
        start = int(self.starts[row])
        return len(needle) <= int(self.starts[row + 1]) - 1 - start and self.text.startswith(needle, start)
