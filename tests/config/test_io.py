"""The schema-free config machinery (gti/config/io.py): strict models, YAML reading, key=value
overrides with YAML-typed values, one-line validation errors, redaction of secrets."""

from typing import Literal

import pytest
from pydantic import ValidationError

from gti.config import io as IO
from gti.common.redact import REDACTED
from gti.common.errors import ConfigError


class _Section(IO.StrictModel):
    size: int = 1
    mode: Literal["a", "b"] = "a"


def test_strict_models_reject_unknown_keys_and_bad_assignments():
    with pytest.raises(ValidationError):
        _Section(sise=2)
    s = _Section()
    with pytest.raises(ValidationError):
        s.mode = "c"


def test_format_error_names_the_key_and_the_source():
    with pytest.raises(ValidationError) as unknown:
        _Section.model_validate({"sise": 2})
    assert IO.format_error(unknown.value, "x.yaml") == "x.yaml: unknown key 'sise'"
    with pytest.raises(ValidationError) as bad:
        _Section.model_validate({"size": "many"})
    line = IO.format_error(bad.value, "x.yaml")
    assert line.startswith("x.yaml: invalid value for 'size': ") and "\n" not in line


@pytest.mark.parametrize("text, value", [
    ("1e-3", 1e-3), ("-2.5E+2", -250.0), ("3", 3), ("[1,2]", [1, 2]), ("true", True),
    ("null", None), ("csv", "csv"), ("a: [1,", "a: [1,"),
])
def test_parse_scalar_reads_values_the_way_yaml_would(text, value):
    assert IO.parse_scalar(text) == value


def test_apply_overrides_builds_sections_and_leaves_the_input_alone():
    raw = {"ground": {"lr": 1.0}}
    out = IO.apply_overrides(raw, ["ground.lr=1e-4", "eval.ks=[1, 2]", "run_dir=x=y"])
    assert out == {"ground": {"lr": 1e-4}, "eval": {"ks": [1, 2]}, "run_dir": "x=y"}
    assert raw == {"ground": {"lr": 1.0}}
    with pytest.raises(ConfigError, match="key=value"):
        IO.apply_overrides(raw, ["nonsense"])
    with pytest.raises(ConfigError, match="empty key"):
        IO.apply_overrides(raw, ["=1"])
    with pytest.raises(ConfigError, match="'lr' is not a section"):
        IO.apply_overrides(raw, ["ground.lr.x=1"])


def test_read_yaml_wants_a_file_holding_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        IO.read_yaml(tmp_path / "nope.yaml")
    (tmp_path / "empty.yaml").write_text("")
    assert IO.read_yaml(tmp_path / "empty.yaml") == {}
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        IO.read_yaml(tmp_path / "list.yaml")
    (tmp_path / "broken.yaml").write_text("a: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        IO.read_yaml(tmp_path / "broken.yaml")
    (tmp_path / "ok.yaml").write_text("sid:\n  levels: 3\n")
    assert IO.read_yaml(tmp_path / "ok.yaml") == {"sid": {"levels": 3}}


def test_redaction_of_secret_like_keys():
    raw = {"auth_token": "abc", "api_key": "k", "nested": {"db_password": "p"},
           "max_tokens": 256, "keys": [1], "items": [{"secret": "s"}]}
    out = IO.redact(raw)
    assert out["auth_token"] == REDACTED and out["api_key"] == REDACTED
    assert out["nested"]["db_password"] == REDACTED and out["items"][0]["secret"] == REDACTED
    assert out["max_tokens"] == 256 and out["keys"] == [1]
    assert raw["auth_token"] == "abc", "a copy; the input is unchanged"
