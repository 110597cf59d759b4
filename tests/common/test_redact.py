"""gti/common/redact.py (issue 30, item 8): secrets stay secret.

Key names are secret in any spelling (`apiKey`, `api-key`, `auth`, `passphrase`,
`connection_string`), credentials inside URIs (`user:pass@`, presigned query strings) are
removed from every config value, manifest, log line and CLI error, and a count such as
`max_tokens` is never mistaken for a secret (a redacted config.yaml is read back by later
commands, so a false positive would break them)."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from gti import config as C
from gti.run import pipeline as P
from gti.config.io import redact
from gti.run.contract import StageResult, StageSpec
from gti.run.manifest import Manifest
from gti.common.redact import REDACTED, is_secret_key, redact_strings, redact_text

ROOT = Path(__file__).resolve().parents[2]
SECRET = "hunter2-s3cr3t"
URI = f"https://alice:{SECRET}@data.example.com/catalog/items.parquet"
PRESIGNED = ("https://bucket.s3.amazonaws.com/items.parquet?X-Amz-Algorithm=AWS4-HMAC-SHA256"
             f"&X-Amz-Credential=AKIA{SECRET}%2F20240101&X-Amz-Date=20240101T000000Z&X-Amz-Expires=3600"
             f"&X-Amz-SignedHeaders=host&X-Amz-Security-Token=tok{SECRET}&X-Amz-Signature=sig{SECRET}")


@pytest.mark.parametrize("key", [
    "api_key", "apiKey", "api-key", "APIKey", "apikey", "auth", "basic_auth", "Authorization", "passphrase",
    "db.passphrase", "connection_string", "connectionString", "connection-string", "AWSAccessKeyId",
    "aws_secret_access_key", "secretAccessKey", "sas_token", "client_secret", "private_key", "password",
    "X-Amz-Signature", "X-Amz-Credential", "X-Amz-Security-Token", "sig", "token", "credentials",
])
def test_secret_keys_in_any_spelling(key):
    assert is_secret_key(key)
    assert redact({"outer": {key: SECRET}}) == {"outer": {key: REDACTED}}


@pytest.mark.parametrize("key", ["max_tokens", "token_format", "add_tokens", "keys", "monkey", "sid_markers",
                                 "mlflow_uri", "tiny_tied", "region", "endpoint_url", "X-Amz-Date", "sort"])
def test_ordinary_keys_are_kept(key):
    assert not is_secret_key(key)
    assert redact({key: "value"}) == {key: "value"}


def test_uri_credentials_and_presigned_query_values_are_removed():
    assert redact_text(URI) == "https://***@data.example.com/catalog/items.parquet"
    out = redact_text(PRESIGNED)
    assert SECRET not in out
    for name in ("X-Amz-Credential", "X-Amz-Security-Token", "X-Amz-Signature"):
        assert f"{name}=***" in out
    assert "X-Amz-Date=20240101T000000Z" in out and "X-Amz-Expires=3600" in out  # not secrets
    assert redact_text(f"https://acct.blob.core.windows.net/c/x.csv?sv=2022&sp=r&sig={SECRET}") == \
        "https://acct.blob.core.windows.net/c/x.csv?sv=2022&sp=r&sig=***"
    assert redact_text(f"cannot read postgres://u:{SECRET}@db:5432/x (and s3://bucket/k)") == \
        "cannot read postgres://***@db:5432/x (and s3://bucket/k)"
    assert redact_text(f"gs://b/k?token={SECRET}#part") == "gs://b/k?token=***#part"
    assert redact_text(redact_text(URI)) == redact_text(URI)  # idempotent
    assert redact_text("/local/path/user@host.csv") == "/local/path/user@host.csv"
    assert redact_text(7) == 7
    assert redact_strings({"a": [URI, 1, {"b": PRESIGNED}]})["a"][2]["b"] == redact_text(PRESIGNED)


def test_config_values_with_uris_are_redacted_and_show_keeps_the_rest():
    cfg = C.load(None, [f"data.items.path={URI}", f"tracking.mlflow_uri=https://bob:{SECRET}@mlflow.example.com",
                        f"data.interactions.storage_options.apiKey={SECRET}",
                        "data.interactions.storage_options.region=eu-1"])
    shown = C.dump(cfg)
    assert SECRET not in shown
    red = redact(cfg.model_dump(mode="json"))
    assert red["data"]["items"]["path"] == "https://***@data.example.com/catalog/items.parquet"
    assert red["tracking"]["mlflow_uri"] == "https://***@mlflow.example.com"
    assert red["data"]["interactions"]["storage_options"] == {"apiKey": REDACTED, "region": "eu-1"}


def test_no_real_config_key_is_mistaken_for_a_secret():
    """config.yaml is written redacted and read back (gti refresh, gti recommend, compare's
    records): every key of every shipped config must pass through unchanged."""
    for raw in [C.RunConfig().model_dump(mode="json")] + [
            C.load(p).model_dump(mode="json") for p in sorted((ROOT / "jobs" / "configs").glob("*.yaml"))]:
        assert redact(raw) == raw


# --------------------------------------------------------------------------- where values leave
def _fake_stage(name: str):
    mod = types.ModuleType(f"fake_redact_{name}")

    def run(ctx):
        ctx.log(f"reading {ctx.cfg.data.items.path}")
        (ctx.work_dir / "out.txt").write_text("ok")
        return StageResult(outputs={"out": "out.txt"},
                           facts={"source": ctx.cfg.data.items.path,
                                  "skipped_files": [{"file": PRESIGNED, "reason": f"cannot open {URI}"}]})

    mod.run = run
    return mod


def test_a_secret_in_a_uri_is_absent_from_manifests_config_files_and_logs(tmp_path, monkeypatch, capsys):
    spec = StageSpec("a", "fake_redact_a", (), ("data", "tracking"), "a")
    monkeypatch.setitem(sys.modules, spec.module, _fake_stage("a"))
    monkeypatch.setattr(P, "STAGES", [spec])
    monkeypatch.setattr(P, "STAGE_NAMES", ["a"])
    cfg = C.load(None, [f"run_dir={tmp_path / 'run'}", f"data.items.path={URI}",
                        f"tracking.mlflow_uri=https://bob:{SECRET}@mlflow.example.com"])
    P.run(cfg, echo=lambda m: None)
    run_dir = cfg.resolved_run_dir()
    for f in (run_dir / "a" / "_manifest.json", run_dir / "a" / "config.yaml", run_dir / "config.yaml"):
        assert SECRET not in f.read_text(), f
    facts = Manifest.read(run_dir / "a").facts
    assert facts["source"] == "https://***@data.example.com/catalog/items.parquet"
    assert "X-Amz-Signature=***" in facts["skipped_files"][0]["file"]
    log = capsys.readouterr().err
    assert "reading https://***@data.example.com/catalog/items.parquet" in log and SECRET not in log


def test_manifest_write_removes_uri_credentials_from_any_string(tmp_path):
    Manifest(stage="x", fingerprint="f", config={}, inputs={"items": URI},
             facts={"deep": [{"f": PRESIGNED}]}).write(tmp_path)
    text = (tmp_path / "_manifest.json").read_text()
    assert SECRET not in text and json.loads(text)["inputs"]["items"].startswith("https://***@")


def test_the_cli_error_line_has_no_uri_credentials(capsys, monkeypatch):
    from gti import cli
    from gti.common.errors import DataError

    def fail(args):
        raise DataError(f"data.items.path: cannot list {URI}: access denied")

    monkeypatch.setattr(cli, "cmd_config", fail)
    assert cli.main(["config", "show"]) == 2
    err = capsys.readouterr().err
    assert SECRET not in err and "https://***@data.example.com" in err
