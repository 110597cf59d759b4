"""The schema-free machinery of config files: strict models, YAML, overrides, redaction.

What it is for: `StrictModel`, the pydantic base of every config section (an unknown key fails
loudly instead of being ignored); `read_yaml` (a file -> its top-level mapping, or a one-line
ConfigError); `apply_overrides` (`a.b.c=value` onto a raw mapping, values parsed as YAML would
by `parse_scalar`); `format_error` (a ValidationError -> one line naming the key and the file);
`redact` (secrets masked before anything reaches a manifest or log, by `gti.common.redact`'s
rules); `Seed` and `PositiveInt`, bounded types several sections share. `gti.config` builds the
run config from these; `gti.vocab_ground` builds its own.

What it does NOT know: any config section or its defaults (`gti.config`, `gti.config.train`),
how stages run, or anything about Ray. It never imports ray or torch.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gti.common.errors import ConfigError
from gti.common.redact import REDACTED, is_secret_key, redact_text


# Bounds that would otherwise fail hours into a run (a negative seed in the first Ray Data
# shuffle, a zero-width layer or a zero K): checked when the config is validated, naming the key.
SEED_MAX = 2**32 - 1  # numpy's and Ray Data's seeds are uint32
Seed = Annotated[int, Field(ge=0, le=SEED_MAX)]
PositiveInt = Annotated[int, Field(gt=0)]


class StrictModel(BaseModel):
    """Base of every config section: unknown keys rejected, assignments validated."""

    # extra="forbid" is what makes a mistyped key fail loudly instead of being ignored.
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def redact(obj: Any) -> Any:
    """Copy of a nested mapping with values of secret-looking keys replaced and the credentials
    inside URIs in every other string removed (`redact_text`).

    Used for everything written to manifests and logs, so that a token put in a config never
    lands on disk. The key match is on the last word(s) of the key in any spelling
    (`auth_token`, `apiKey`, `api-key`, `auth`, `passphrase`, `connection_string`;
    `is_secret_key`), so `max_tokens` (a count) is left alone.
    """
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out[k] = REDACTED if is_secret_key(k) else redact(v)
        return out
    if isinstance(obj, list):
        return [redact(v) for v in obj]
    return redact_text(obj)


def parse_scalar(text: str) -> Any:
    """Parse an override value the way YAML would ("1e-3" -> float, "[1,2]" -> list)."""
    try:
        val = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    # YAML 1.1 reads "1e-3" as a string; accept it as a float like a human would.
    if isinstance(val, str):
        try:
            return float(val) if re.fullmatch(r"[-+]?\d*\.?\d+[eE][-+]?\d+", val) else val
        except ValueError:
            return val
    return val


def apply_overrides(raw: dict[str, Any], overrides: list[str], source: str = "<overrides>") -> dict:
    """Return a copy of `raw` with `a.b.c=value` overrides applied (validation comes later)."""
    out = copy.deepcopy(raw)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value")
        key, value = item.split("=", 1)
        key = key.strip()
        if not key:
            raise ConfigError(f"override '{item}' has an empty key")
        node = out
        parts = key.split(".")
        for p in parts[:-1]:
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"override '{key}': '{p}' is not a section")
            node = nxt
        node[parts[-1]] = parse_scalar(value)
    return out


def format_error(err: ValidationError, source: str) -> str:
    """One line for a pydantic error: the first problem, its dotted key and `source`."""
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"])
    if first["type"] == "extra_forbidden":
        return f"{source}: unknown key '{loc}'"
    msg = first["msg"]
    return f"{source}: invalid value for '{loc}': {msg}" if loc else f"{source}: {msg}"


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The top-level mapping of a YAML file; ConfigError when missing, malformed or not a mapping."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{p}: not valid YAML: {str(err).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: top level must be a mapping")
    return raw
