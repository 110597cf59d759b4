"""bench/proof/gpu_proof.sh, the prepared one-GPU proof run (it has not run on a GPU yet, so
nothing else checks it): its `gti compare` line must name a config, arms and overrides that
gti accepts today, and plan the three arms with every training stage and the rl stage on the
GPU; a renamed config key or arm fails here instead of in the one session that is lent a GPU."""

from __future__ import annotations

import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "proof" / "gpu_proof.sh"


def compare_args(out: str) -> list[str]:
    """The words after `"$GTI" compare` in the script, continuation lines joined, $OUT set."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    line = next(ln for ln in text.splitlines() if ln.lstrip().startswith('"$GTI" compare'))
    words = shlex.split(line.replace('"$OUT"', out).replace("$OUT", out))
    return words[2:]


def parse(args: list[str]) -> tuple[dict[str, str], list[str]]:
    """(--flag values, the key=value overrides)."""
    flags, overrides, it = {}, [], iter(args)
    for w in it:
        if w.startswith("--"):
            flags[w] = next(it)
        else:
            overrides.append(w)
    return flags, overrides


def test_the_gpu_proof_command_plans_three_arms_on_the_gpu(tmp_path):
    from gti import config as C
    from gti.experiments.compare import parse_arms, plan

    flags, overrides = parse(compare_args(str(tmp_path / "out")))
    assert set(flags) == {"--config", "--arms", "--seeds", "--out"}
    assert all("=" in o for o in overrides), overrides
    cfg = C.load(ROOT / flags["--config"], overrides)  # raises on an unknown key or a bad value
    arms = parse_arms(flags["--arms"])
    assert arms == ["mean", "gti", "gti+rl"]
    runs = plan(cfg, arms, flags["--seeds"], Path(flags["--out"]))
    assert [r.arm for r in runs] == arms
    by_arm = {r.arm: r.cfg for r in runs}
    for arm_cfg in by_arm.values():
        assert arm_cfg.ground.use_gpu and arm_cfg.sft.use_gpu and arm_cfg.sid.use_gpu
        assert arm_cfg.eval.num_gpus == 1
    assert by_arm["gti+rl"].rl.enabled and by_arm["gti+rl"].rl.use_gpu
    assert not by_arm["gti"].rl.enabled and not by_arm["mean"].ground.enabled
    assert by_arm["gti+rl"].rl.steps == 100


def test_the_gpu_check_uses_the_venvs_python():
    text = SCRIPT.read_text()
    assert 'python3 -c "import torch' not in text
    assert '"${PY:-.venv/bin/python}" -c "import torch' in text
