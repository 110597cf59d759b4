"""gti/config/serve.py: the serve: section's defaults (safe: 127.0.0.1, no token needed
except for /admin, mounted at /), its bounds, the route prefix's form, its place in RunConfig
(overrides, a dump that loads back), and a description on every field."""

from __future__ import annotations

import pytest
import yaml

from gti import config as C
from gti.config.serve import ServeConfig
from gti.common.errors import ConfigError


def test_defaults_are_local_and_in_the_run_config():
    cfg = C.load(None)
    assert cfg.serve == ServeConfig()
    assert (cfg.serve.host, cfg.serve.port, cfg.serve.token_required, cfg.serve.unknown_items) == \
        ("127.0.0.1", 8000, False, "ignore")
    assert C.load(None, ["serve.port=9000", "serve.unknown_items=error"]).serve.port == 9000
    # The dump (what a run folder keeps) loads back: no serve key is redacted as a secret.
    assert C.validate(yaml.safe_load(C.dump(cfg))).serve == cfg.serve


@pytest.mark.parametrize("override, key", [
    ("serve.port=0", "serve.port"), ("serve.max_k=1001", "serve.max_k"), ("serve.replicas=0", "serve.replicas"),
    ("serve.unknown_items=drop", "serve.unknown_items"), ("serve.min_replicas=1", "max_replicas"),
    ("serve.bogus=1", "serve.bogus"),
])
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError, match=key):
        C.load(None, [override])


def test_autoscaling_bounds():
    assert ServeConfig(min_replicas=1, max_replicas=3).autoscaling
    assert not ServeConfig().autoscaling
    with pytest.raises(ValueError, match="exceeds max_replicas"):
        ServeConfig(min_replicas=4, max_replicas=3)


def test_every_field_has_a_description():
    missing = [name for name, f in ServeConfig.model_fields.items() if not f.description]
    assert not missing, missing


@pytest.mark.parametrize("prefix", ["/", "/gti", "/api/gti-v2", "/a.b_c~d"])
def test_route_prefix_accepts_a_path(prefix):
    assert ServeConfig().route_prefix == "/"
    assert C.load(None, [f"serve.route_prefix={prefix}"]).serve.route_prefix == prefix


@pytest.mark.parametrize("prefix", ["gti", "/gti/", "//", "/a//b", "/g ti", "/gti?x=1", "/gti#top", "/{app}", ""])
def test_a_bad_route_prefix_names_the_key_and_the_value(prefix):
    with pytest.raises(ConfigError, match="serve.route_prefix") as err:
        C.load(None, [f"serve.route_prefix={prefix}"])
    if prefix:  # an empty override is null: "not a valid string"
        assert repr(prefix) in str(err.value)
    with pytest.raises(ValueError, match="route_prefix"):
        ServeConfig(route_prefix=prefix)


def test_the_batch_wait_depends_on_where_the_replica_decodes_unless_set():
    cfg = ServeConfig()
    assert cfg.batch_wait_timeout_s is None
    assert cfg.batch_wait_for("cpu") == 0.25 and cfg.batch_wait_for("cuda") == 0.01
    assert ServeConfig(batch_wait_timeout_s=0.05).batch_wait_for("cpu") == 0.05
    assert ServeConfig(batch_wait_timeout_s=0).batch_wait_for("cuda") == 0
    with pytest.raises(ValueError, match="batch_wait_timeout_s"):
        ServeConfig(batch_wait_timeout_s=-1)
