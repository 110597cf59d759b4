"""Issue 31, item 6: every config field is documented where it is declared, and
`gti config show --explain` prints each resolved key with its value, default and meaning
(gti/config/explain.py), on every shipped config."""

from __future__ import annotations

import json
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from gti import config as C
from gti.config import explain as X
from gti.cli import main
from gti.config.io import StrictModel
from gti.common.redact import REDACTED

CONFIGS = Path(__file__).resolve().parents[2] / "jobs" / "configs"
SHIPPED = sorted(CONFIGS.glob("*.yaml"))
TINY = CONFIGS / "tiny.yaml"


def _models_in(annotation) -> list[type[BaseModel]]:
    """Config models inside a field's type (plain, Optional, list[...], dict[..., ...])."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _all_models() -> list[type[BaseModel]]:
    """RunConfig and every model reachable from it, plus every StrictModel declared in a
    gti.config* module (a section not yet attached to RunConfig is still checked) or in
    gti.vocab_ground (`gti vocab ground --config`)."""
    seen: list[type[BaseModel]] = []
    import gti.vocab_ground  # noqa: F401 - declares the `gti vocab ground` config models

    todo = [C.RunConfig] + [m for m in _subclasses(StrictModel)
                            if m.__module__.startswith(("gti.config", "gti.vocab_ground"))]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.append(m)
        todo += [sub for f in m.model_fields.values() for sub in _models_in(f.annotation)]
    return seen


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub] + _subclasses(sub)
    return out


def _leaf_keys(model: type[BaseModel], prefix: str = "") -> set[str]:
    out: set[str] = set()
    for name, f in model.model_fields.items():
        subs = _models_in(f.annotation)
        out |= _leaf_keys(subs[0], prefix + name + ".") if subs else {prefix + name}
    return out


def _at(cfg, key: str):
    # Read from the model, not its dump: keys left out of dumps at their default (sid.seed while
    # None, data.split while leave_one_out, so earlier fingerprints stand) still have a value.
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return json.loads(json.dumps(cfg))


def test_every_field_of_every_config_model_has_a_description():
    models = _all_models()
    assert {"RunConfig", "SidConfig", "TrainConfig", "SftConfig", "EvalConfig", "SasrecConfig",
            "ServeConfig", "RefreshConfig"} <= {m.__name__ for m in models}
    missing = [f"{m.__module__}.{m.__name__}.{name}" for m in models
               for name, f in m.model_fields.items() if not (f.description or "").strip()]
    assert not missing, f"config fields without Field(description=...): {missing}"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_explain_on_every_shipped_config_prints_every_key_with_value_default_and_meaning(path, capsys):
    assert main(["config", "show", "--explain", "-c", str(path)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == X.LEGEND
    cfg = C.load(path)
    resolved, defaults = cfg, C.RunConfig()
    rows = X.rows(cfg)
    assert {r.key for r in rows} == _leaf_keys(C.RunConfig) and len(rows) == len(_leaf_keys(C.RunConfig))
    by_key = {ln[2:].split(" = ", 1)[0].rstrip(): ln for ln in lines if ln[:1] in " *" and " = " in ln}
    assert set(by_key) == {r.key for r in rows}, "one line per key, every key"
    for r in rows:
        line = by_key[r.key]
        assert json.loads(r.value) == _at(resolved, r.key), r.key
        assert json.loads(r.default) == _at(defaults, r.key), r.key
        assert r.description and line.endswith(f"= {r.value}  (default: {r.default})  {r.description}"), line
        assert line.startswith("*" if r.value != r.default else " "), line
    for key, description in X.sections(cfg):
        assert f"[{key}]  {description}" in lines


def test_a_value_overridden_on_the_command_line_shows_value_unlike_default(capsys):
    assert main(["config", "show", "--explain", "-c", str(TINY), "ground.lr=0.05", "eval.ks=[1,2]"]) == 0
    lines = capsys.readouterr().out.splitlines()
    lr = next(ln for ln in lines if ln[2:].startswith("ground.lr "))
    assert lr.startswith("* ") and "= 0.05  (default: 0.001)" in lr and "learning rate" in lr
    ks = next(ln for ln in lines if ln[2:].startswith("eval.ks "))
    assert ks.startswith("* ") and "= [1, 2]  (default: [5, 10, 20])" in ks
    seed = next(ln for ln in lines if ln[2:].startswith("seed "))
    assert seed.startswith("  ") and "= 0  (default: 0)" in seed


def test_explain_redacts_secrets_like_config_show(capsys):
    assert main(["config", "show", "--explain", "data.items.storage_options={api_key: s3cr3t}"]) == 0
    out = capsys.readouterr().out
    assert "s3cr3t" not in out and REDACTED in out


def test_explain_goes_with_show_only(capsys):
    assert main(["config", "validate", "--explain", "-c", str(TINY)]) == 2
    err = capsys.readouterr().err
    assert "--explain" in err and len(err.strip().splitlines()) == 1
