"""The CLI in-process: handlers, one-line user errors, exit codes."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gti.cli import main

TINY = str(Path(__file__).resolve().parents[1] / "jobs" / "configs" / "tiny.yaml")


def test_config_show_prints_resolved_yaml_with_overrides(capsys):
    assert main(["config", "show", "--config", TINY, "ground.lr=0.5"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["ground"]["lr"] == 0.5 and shown["model"]["name"] == "tiny"


def test_overrides_accepted_before_and_after_options(capsys):
    assert main(["config", "show", "seed=3", "--config", TINY, "sid.levels=3"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["seed"] == 3 and shown["sid"]["levels"] == 3


def test_config_validate_ok_and_bad_key(capsys):
    assert main(["config", "validate", "-c", TINY]) == 0
    assert "OK" in capsys.readouterr().out
    assert main(["config", "validate", "-c", TINY, "sid.levles=3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "sid.levles" in err and "Traceback" not in err


def test_run_with_missing_upstream_is_one_line(tmp_path, capsys):
    rc = main(["run", "-c", TINY, "--from", "sft", f"run_dir={tmp_path}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith("gti: error:") and "ingest" in err[-1]


def test_bad_arguments_exit_nonzero():
    with pytest.raises(SystemExit) as e:
        main(["run", "-c", TINY, "--bogus"])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        main(["nosuchcommand"])


def test_python_dash_m_entry_point():
    out = subprocess.run([sys.executable, "-m", "gti", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for cmd in ["run", "stage", "config", "data", "recommend", "compare", "tune"]:
        assert cmd in out.stdout
