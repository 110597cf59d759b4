"""Every shipped run config (jobs/configs/*.yaml) loads through gti.config, and the paper
configuration holds the paper's settings. Parametrised over the folder, so configs added later
are covered without touching this file."""

from __future__ import annotations

from pathlib import Path

import pytest

from gti import config
from gti.common.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "jobs" / "configs").glob("*.yaml"))
PAPER = ROOT / "jobs" / "configs" / "paper-qwen3-0.6b.yaml"


def test_configs_folder_is_not_empty():
    assert PAPER in CONFIGS and len(CONFIGS) >= 3


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_loads(path):
    cfg = config.load(path)
    assert isinstance(cfg, config.RunConfig)
    # The first line names the command that runs this very file.
    first = path.read_text().splitlines()[0]
    assert first.startswith("#") and f"jobs/configs/{path.name}" in first, first


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_survives_dump_and_reload(path, tmp_path):
    # What `gti config show` prints (and what tune writes as best.yaml) is itself a valid config.
    cfg = config.load(path)
    out = tmp_path / "again.yaml"
    out.write_text(config.dump(cfg))
    assert config.load(out) == cfg


def test_paper_config_holds_the_paper_settings():
    cfg = config.load(PAPER)
    assert Path(cfg.model.name).is_absolute(), "the paper model is read from a local folder"
    assert cfg.model.trust_remote_code is False
    assert (cfg.sid.method, cfg.sid.levels, cfg.sid.codebook_size, cfg.sid.code_dim) == ("rqvae", 4, 256, 32)
    assert cfg.sid.encoder_dims == [512, 256] and cfg.sid.dropout == 0.1
    assert cfg.sid.sinkhorn_last_level and cfg.sid.diversity_weight > 0
    assert cfg.embed.encoder == "lm"  # 1024-d embeddings from Qwen3-0.6B itself
    g = cfg.ground
    assert (g.steps, g.batch_size, g.lr) == (8000, 128, 1e-3)
    s = cfg.sft
    assert (s.steps, s.batch_size) == (1600, 512)
    for t in (g, s):
        assert t.use_gpu and t.precision == "bf16" and t.num_workers > 1
    assert cfg.ray_address == "auto" and cfg.ray_num_cpus is None
    assert cfg.eval.ks == [5, 10, 20, 50, 100]


def test_bad_key_in_a_config_is_named(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(PAPER.read_text().replace("  code_dim: 32", "  code_dims: 32"))
    with pytest.raises(ConfigError, match="code_dims"):
        config.load(bad)


def test_ml100k_config_is_the_demo_recipe_with_only_its_data_files_changed():
    """The transfer figure means something only while every recipe key equals the demo's."""
    def recipe(name):
        cfg = config.load(ROOT / "jobs" / "configs" / name).model_dump(mode="json")
        cfg.pop("run_dir")
        cfg["data"].pop("items"), cfg["data"].pop("interactions")
        return cfg

    assert recipe("ml100k.yaml") == recipe("demo.yaml")
    cfg = config.load(ROOT / "jobs" / "configs" / "ml100k.yaml")
    assert cfg.data.items.path.endswith("ml-100k/items.csv") and cfg.data.interactions.columns.ts == "ts"
