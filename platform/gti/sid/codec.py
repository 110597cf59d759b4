"""Semantic-ID codec: codes <-> token strings <-> token ids of a given tokenizer.

What it is for: one place that knows how a SID (a row of L integer codes) is spelled as new
vocabulary tokens (`<a_12><b_201><c_7>` with the default format; level `l` is the letter
`chr(ord('a') + l)`) and which tokenizer ids those tokens have. Later stages build SID token ids
from here, never by re-tokenising rendered text (a tokenizer may put a separate space token in
front of an added token).

What it does not know: how codes were produced (see `gti.sid.rqvae` / the `sid` stage), how the
tokenizer is extended (`gti.lm.new_rows`), or anything about Ray. Pure python + torch.
"""

from __future__ import annotations

import re
import string
from typing import Any, Iterable, Sequence

import torch

from gti.common.errors import DataError


class SidFormatError(DataError, ValueError):
    """A SID string or code row that does not fit this codec (one line, names the bad input)."""


def level_letter(level: int) -> str:
    if not 0 <= level < 26:
        raise ValueError(f"level {level} out of range 0..25 (levels are spelled a..z)")
    return string.ascii_lowercase[level]


def codes_added(old_sizes: Sequence[int], new_sizes: Sequence[int]) -> list[tuple[int, int]]:
    """(level, code) of every code `new_sizes` has beyond `old_sizes`, level-major (the codes a
    map gains when a refresh grows a level, `gti.sid.map_edits.add_last_level_codes`; their
    tokens are `codec.token(level, code)`). ValueError when the level counts differ or a level
    shrank."""
    old, new = [int(k) for k in old_sizes], [int(k) for k in new_sizes]
    if len(old) != len(new):
        raise ValueError(f"codebook sizes {new} have {len(new)} levels, {old} has {len(old)}")
    if any(n < o for o, n in zip(old, new)):
        raise ValueError(f"codebook sizes {new} are smaller than {old} at some level")
    return [(lv, c) for lv in range(len(old)) for c in range(old[lv], new[lv])]


class SidCodec:
    """Spelling of SIDs with `levels` levels.

    Args:
        levels: L, number of code positions in a SID.
        codebook_sizes: K_l per level (len L); a single int means the same K for all levels.
        token_format: python format string with `{level}` (a letter) and `{code}` (an int).
    """

    def __init__(
        self,
        levels: int,
        codebook_sizes: Sequence[int] | int,
        token_format: str = "<{level}_{code}>",
    ) -> None:
        if isinstance(codebook_sizes, int):
            codebook_sizes = [codebook_sizes] * levels
        sizes = [int(k) for k in codebook_sizes]
        if levels < 1 or levels > 26:
            raise ValueError(f"levels must be in 1..26, got {levels}")
        if len(sizes) != levels:
            raise ValueError(f"codebook_sizes has {len(sizes)} entries for {levels} levels")
        if any(k < 1 for k in sizes):
            raise ValueError(f"codebook_sizes must be positive, got {sizes}")
        if "{level}" not in token_format or "{code}" not in token_format:
            raise ValueError("token_format must contain {level} and {code}")
        self.levels = levels
        self.codebook_sizes = sizes
        self.token_format = token_format
        self._tokens = [
            token_format.format(level=level_letter(lv), code=c)
            for lv in range(levels)
            for c in range(sizes[lv])
        ]
        self._token_to_lc = {}
        for lv in range(levels):
            for c in range(sizes[lv]):
                self._token_to_lc[self.token(lv, c)] = (lv, c)
        if len(self._token_to_lc) != len(self._tokens):
            raise ValueError(f"token_format {token_format!r} spells two codes the same way")
        # One token = the format with its two fields replaced by capture groups; the literal
        # parts are escaped, so formats such as "[{level}{code}]" work too.
        pat = re.escape(token_format)
        pat = pat.replace(re.escape("{level}"), "(?P<level>[a-z])", 1)
        pat = pat.replace(re.escape("{code}"), "(?P<code>[0-9]+)", 1)
        self._token_re = re.compile(pat)
        self._level_start = [0]
        for k in sizes:
            self._level_start.append(self._level_start[-1] + k)

    # ------------------------------------------------------------------ construction helpers
    @classmethod
    def from_facts(cls, facts: dict[str, Any]) -> "SidCodec":
        """Codec of a finished `sid` stage, from its manifest facts."""
        return cls(int(facts["levels"]), list(facts["codebook_sizes"]), facts["token_format"])

    def __repr__(self) -> str:
        return f"SidCodec(levels={self.levels}, codebook_sizes={self.codebook_sizes}, token_format={self.token_format!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SidCodec) and (
            self.levels, self.codebook_sizes, self.token_format
        ) == (other.levels, other.codebook_sizes, other.token_format)

    # ------------------------------------------------------------------ strings
    @property
    def num_tokens(self) -> int:
        """|V_new| = sum of codebook sizes."""
        return len(self._tokens)

    def token(self, level: int, code: int) -> str:
        return self.token_format.format(level=level_letter(level), code=int(code))

    def tokens(self) -> list[str]:
        """All new token strings, level-major then code: [a_0 .. a_{K0-1}, b_0, ...]: the order in
        which they are added to the tokenizer, so new-token id = first_new_id + rank. (Codes a
        refresh adds to the last level later, `codes_added`, are appended after whatever the
        tokenizer then ends with, so for a grown codec look ids up through the tokenizer,
        `code_to_token_id_table` / `token_ids`, not with the `*_from_offset` helpers.)"""
        return list(self._tokens)

    def token_rank(self, level: int, code: int) -> int:
        """Position of (level, code) in `tokens()`."""
        return self._level_start[level] + int(code)

    def _check_codes(self, codes: Sequence[int]) -> list[int]:
        row = [int(c) for c in codes]
        if len(row) != self.levels:
            raise SidFormatError(f"SID {row} has {len(row)} codes; this codec has {self.levels} levels")
        for lv, c in enumerate(row):
            if not 0 <= c < self.codebook_sizes[lv]:
                raise SidFormatError(
                    f"SID {row}: code {c} at level {level_letter(lv)} is outside 0..{self.codebook_sizes[lv] - 1}"
                )
        return row

    def to_string(self, codes: Sequence[int] | torch.Tensor) -> str:
        """[12, 201, 7] -> '<a_12><b_201><c_7>'."""
        if isinstance(codes, torch.Tensor):
            codes = codes.tolist()
        row = self._check_codes(codes)
        return "".join(self.token(lv, c) for lv, c in enumerate(row))

    def to_strings(self, codes: torch.Tensor | Iterable[Sequence[int]]) -> list[str]:
        """Batch version of `to_string` for an [N, L] array of codes."""
        if isinstance(codes, torch.Tensor):
            codes = codes.tolist()
        return [self.to_string(r) for r in codes]

    def from_string(self, s: str) -> list[int]:
        """'<a_12><b_201><c_7>' -> [12, 201, 7]; surrounding whitespace is ignored.

        Raises SidFormatError naming the string when it is not exactly L tokens of this codec,
        levels in order a, b, c, ..., codes in range.
        """
        text = s.strip()
        codes: list[int] = []
        pos = 0
        while pos < len(text):
            m = self._token_re.match(text, pos)
            if m is None:
                raise SidFormatError(
                    f"malformed SID {s!r}: unexpected text at position {pos} ({text[pos:pos + 12]!r})"
                )
            lv = ord(m.group("level")) - ord("a")
            if lv != len(codes):
                raise SidFormatError(
                    f"malformed SID {s!r}: level {m.group('level')!r} where level "
                    f"{level_letter(len(codes)) if len(codes) < 26 else '?'} was expected"
                )
            if lv >= self.levels:
                raise SidFormatError(f"malformed SID {s!r}: more than {self.levels} levels")
            codes.append(int(m.group("code")))
            pos = m.end()
        if len(codes) != self.levels:
            raise SidFormatError(f"malformed SID {s!r}: {len(codes)} levels, expected {self.levels}")
        return self._check_codes(codes)

    # ------------------------------------------------------------------ token ids
    def code_to_token_id_table(self, tokenizer) -> torch.Tensor:
        """LongTensor[L, Kmax]: tokenizer id of (level, code); -1 where code >= K_level.

        Raises SidFormatError naming the first new token the tokenizer does not know.
        """
        toks = self._tokens
        ids = tokenizer.convert_tokens_to_ids(toks)
        unk_id = getattr(tokenizer, "unk_token_id", None)
        unk_tok = getattr(tokenizer, "unk_token", None)
        for t, i in zip(toks, ids):
            # Slow/fast HF tokenizers return None or the unk id for unknown tokens.
            if i is None or (unk_id is not None and i == unk_id and t != unk_tok):
                raise SidFormatError(
                    f"SID token {t!r} is not in the tokenizer's vocabulary (extend it first)"
                )
        kmax = max(self.codebook_sizes)
        table = torch.full((self.levels, kmax), -1, dtype=torch.long)
        flat = torch.tensor(ids, dtype=torch.long)
        for lv in range(self.levels):
            k = self.codebook_sizes[lv]
            table[lv, :k] = flat[self._level_start[lv] : self._level_start[lv] + k]
        return table

    def _codes_tensor(self, codes) -> torch.Tensor:
        codes = torch.as_tensor(codes, dtype=torch.long)
        if codes.ndim == 1:
            codes = codes.unsqueeze(0)
        if codes.ndim != 2 or codes.shape[1] != self.levels:
            raise SidFormatError(f"codes must have shape [N, {self.levels}], got {list(codes.shape)}")
        sizes = torch.tensor(self.codebook_sizes, dtype=torch.long)
        bad = (codes < 0) | (codes >= sizes)
        if bad.any():
            r, c = (int(v) for v in bad.nonzero()[0])
            raise SidFormatError(
                f"code row {r}: code {int(codes[r, c])} at level {level_letter(c)} is outside "
                f"0..{self.codebook_sizes[c] - 1}"
            )
        return codes

    def token_ids(self, codes: torch.Tensor, tokenizer) -> torch.Tensor:
        """codes LongTensor[N, L] -> tokenizer ids LongTensor[N, L]."""
        codes = self._codes_tensor(codes)
        table = self.code_to_token_id_table(tokenizer)
        return table[torch.arange(self.levels).unsqueeze(0), codes]

    def level_offsets(self, first_new_id: int) -> torch.Tensor:
        """LongTensor[L]: id of code 0 of each level when `tokens()` were added contiguously
        starting at `first_new_id` (id of (l, c) = offsets[l] + c)."""
        return torch.tensor(self._level_start[:-1], dtype=torch.long) + int(first_new_id)

    def token_ids_from_offset(self, codes: torch.Tensor, first_new_id: int) -> torch.Tensor:
        """codes [N, L] -> ids [N, L] without a tokenizer, for contiguously added tokens."""
        codes = self._codes_tensor(codes)
        return codes + self.level_offsets(first_new_id).unsqueeze(0)

    def codes_from_token_ids(self, ids: torch.Tensor, first_new_id: int) -> torch.Tensor:
        """ids [N, L] of contiguously added tokens -> codes [N, L]; rows with any token that
        is not the right level's SID token become all -1."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        if ids.ndim == 1:
            ids = ids.unsqueeze(0)
        codes = ids - self.level_offsets(first_new_id).to(ids.device).unsqueeze(0)
        sizes = torch.tensor(self.codebook_sizes, dtype=torch.long, device=ids.device)
        ok = ((codes >= 0) & (codes < sizes)).all(dim=1, keepdim=True)
        return torch.where(ok, codes, torch.full_like(codes, -1))
