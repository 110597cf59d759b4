"""Config loading, validation errors that name the key, overrides, redaction in the dump
(redaction and the file machinery are tested in test_io.py)."""

from pathlib import Path

import pytest
import yaml

from gti import config as C
from gti.common.errors import ConfigError
from gti.common.redact import REDACTED

CONFIGS = Path(__file__).resolve().parents[2] / "jobs" / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads_and_starts_with_its_command(path):
    cfg = C.load(path)
    assert isinstance(cfg, C.RunConfig)
    first = path.read_text().splitlines()[0]
    assert first.startswith("#") and "gti " in first, f"{path.name} must begin with its command"


def test_unknown_key_names_key_and_file(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("sid:\n  levles: 4\n")
    with pytest.raises(ConfigError) as err:
        C.load(p)
    msg = str(err.value)
    assert "sid.levles" in msg and str(p) in msg and "\n" not in msg


def test_bad_value_names_key(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("ground:\n  lr: -1\n")
    with pytest.raises(ConfigError, match="ground.lr"):
        C.load(p)


def test_overrides_are_revalidated_and_typed():
    cfg = C.load(CONFIGS / "tiny.yaml", ["ground.lr=1e-4", "sid.levels=3", "eval.ks=[1,2]"])
    assert cfg.ground.lr == pytest.approx(1e-4) and isinstance(cfg.ground.lr, float)
    assert cfg.sid.levels == 3 and cfg.eval.ks == [1, 2]
    with pytest.raises(ConfigError, match="unknown key 'ground.lrr'"):
        C.load(CONFIGS / "tiny.yaml", ["ground.lrr=1"])
    with pytest.raises(ConfigError, match="sid.levels"):
        C.load(CONFIGS / "tiny.yaml", ["sid.levels=many"])
    with pytest.raises(ConfigError, match="key=value"):
        C.load(CONFIGS / "tiny.yaml", ["nonsense"])


def test_cross_field_validation():
    with pytest.raises(ConfigError, match="beam_width"):
        C.load(None, ["eval.beam_width=5", "eval.ks=[10]"])


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        C.load(tmp_path / "nope.yaml")
    p = tmp_path / "broken.yaml"
    p.write_text("a: [1,\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        C.load(p)


def test_dump_round_trips():
    cfg = C.load(CONFIGS / "tiny.yaml")
    again = C.validate(yaml.safe_load(C.dump(cfg)))
    assert again == cfg


def test_dump_redacts_secrets():
    cfg = C.load(None, ["data.items.storage_options={api_key: k}"])
    assert REDACTED in C.dump(cfg) and "api_key: k" not in C.dump(cfg)


def test_sid_seed_is_typed_and_dumped_only_when_set():
    """None (the run's seed) stays out of dumps, so the sid section of every earlier config is
    unchanged; a set value round-trips; a bad one names the key."""
    assert "seed" not in C.load(None).model_dump(mode="json")["sid"]
    cfg = C.load(CONFIGS / "tiny.yaml", ["sid.seed=7"])
    assert cfg.sid.seed == 7 and cfg.model_dump(mode="json")["sid"]["seed"] == 7
    assert C.validate(yaml.safe_load(C.dump(cfg))) == cfg
    with pytest.raises(ConfigError, match="sid.seed"):
        C.load(None, ["sid.seed=-1"])
