"""`gti config show --explain`: every resolved key of a run config with its value, its default
and its meaning.

What it is for: `rows(cfg)`, one `Row(key, value, default, description)` per leaf of the config
tree (dotted key; nested sections recurse; values and defaults rendered compactly as JSON, which
is also YAML, so a value can be pasted into a `key=value` override; secrets redacted as in
`gti config show`), and `sections(cfg)`, the nested sections with their descriptions;
`explain(cfg)`, the text the command prints: a header line per section, then one line per key,
`*` marking a value that differs from its default.

What it does NOT know: which file or override a value came from, or what any stage does with it
(the descriptions say that, where the fields are declared). It never imports ray or torch.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from gti.config.io import redact

LEGEND = "# key = value  (default: ...)  meaning; * marks a value that differs from its default"


class Row(NamedTuple):
    key: str  # dotted path, e.g. "sid.levels"
    value: str  # compact JSON of the resolved value (redacted)
    default: str  # compact JSON of the field's default (redacted)
    description: str


def _show(name: str, value: Any) -> str:
    """Compact JSON of one value, redacted by the same rules as `gti config show` (by key)."""
    plain = redact({name: to_jsonable_python(value)})[name]
    return json.dumps(plain, separators=(", ", ": "), ensure_ascii=False)


def _entries(model: BaseModel, prefix: str = "") -> list[Row | tuple[str, str]]:
    """In order: a model's own keys (as Rows), then each nested section as (key, description)
    followed by its entries, so that every key is printed under its own section's header."""
    leaves: list[Row | tuple[str, str]] = []
    nested: list[Row | tuple[str, str]] = []
    for name, field in type(model).model_fields.items():
        key, value = prefix + name, getattr(model, name)
        if isinstance(value, BaseModel):
            nested += [(key, field.description or "")] + _entries(value, key + ".")
        else:
            default = field.get_default(call_default_factory=True)
            leaves.append(Row(key, _show(name, value), _show(name, default), field.description or ""))
    return leaves + nested


def rows(cfg: BaseModel) -> list[Row]:
    """Every leaf key of `cfg`: the top level's own keys first, then section by section."""
    return [e for e in _entries(cfg) if isinstance(e, Row)]


def sections(cfg: BaseModel) -> list[tuple[str, str]]:
    """(dotted key, description) of every nested section of `cfg`, in the order of `rows`."""
    return [e for e in _entries(cfg) if not isinstance(e, Row)]


def explain(cfg: BaseModel) -> str:
    """The text of `gti config show --explain`: a legend, the top-level keys, then per section a
    `[section]  meaning` line and one line per key: `* key = value  (default: d)  meaning`."""
    entries = _entries(cfg)
    width = max((len(e.key) for e in entries if isinstance(e, Row)), default=0)
    lines = [LEGEND]
    for e in entries:
        if isinstance(e, Row):
            mark = "*" if e.value != e.default else " "
            lines.append(f"{mark} {e.key:<{width}} = {e.value}  (default: {e.default})  {e.description}")
        else:
            lines.append(f"\n[{e[0]}]  {e[1]}".rstrip())
    return "\n".join(lines) + "\n"
