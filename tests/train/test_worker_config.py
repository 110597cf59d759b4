"""gti/train/worker_config.py: the typed config every worker of the shared loop gets, built in
one place (`WorkerConfig.build`), and the one boundary where it becomes Ray Train's dict
(`gti.train.ray_train.run_trainer`) and comes back (`from_loop_dict`). It finds a task's hooks
through `gti.train.task.hooks_for`, so it imports no task module (no import circle in train/)."""

from __future__ import annotations

import ast
import pickle
import subprocess
import sys
from dataclasses import FrozenInstanceError, replace

import pytest

from gti import config as C
from gti.train import ground_task, rl_task, sft_task, worker_config
from gti.train.worker_config import FaultInjection, GroundRows, RlStart, SftStart, ValSet, WorkerConfig, from_loop_dict


def _ground(**kw) -> WorkerConfig:
    cfg = C.RunConfig(model={"name": "tiny"}, seed=5)
    return WorkerConfig.build("ground", cfg, 3, ground=GroundRows("init.safetensors", 10, 4),
                              val=ValSet("val.parquet", "sids.safetensors", 10, 14, 2), **kw)


def test_build_gives_each_task_its_hooks_and_the_run_config_as_json():
    c = _ground()
    assert (c.task, c.hooks, c.pad_id) == ("ground", ground_task.HOOKS, 3)
    assert C.validate(c.run_config, "t") == C.RunConfig(model={"name": "tiny"}, seed=5)  # JSON, validated again
    assert (c.progress_file, c.fit_id, c.fault, c.sft) == (None, None, None, None)
    s = WorkerConfig.build("sft", C.RunConfig(), 0, sft=SftStart("model"))
    assert s.hooks is sft_task.HOOKS and s.sft.model_dir == "model" and s.val is None and s.ground is None
    with pytest.raises(FrozenInstanceError):
        c.pad_id = 1  # type: ignore[misc]


def test_build_refuses_an_unknown_task_or_another_tasks_input():
    cfg = C.RunConfig()
    with pytest.raises(ValueError, match="unknown training task 'dpo'"):
        WorkerConfig.build("dpo", cfg, 0)
    with pytest.raises(ValueError, match="its own input"):
        WorkerConfig.build("ground", cfg, 0)  # no rows
    with pytest.raises(ValueError, match="its own input"):
        WorkerConfig.build("rl", cfg, 0, sft=SftStart("m"))
    r = WorkerConfig.build("rl", cfg, 0, rl=RlStart("m", "s.safetensors", 64, 88, 3))
    assert r.hooks is rl_task.HOOKS and r.rl.levels == 3 and r.hooks.keep_best == "val_mrr"
    with pytest.raises(ValueError, match="its own input"):
        WorkerConfig.build("sft", cfg, 0, sft=SftStart("m"), ground=GroundRows("i", 1, 1))


def test_ray_trains_dict_carries_the_config_and_the_worker_rebuilds_it(tmp_path):
    """run_trainer flattens the top level (hooks and nested records as objects, the progress
    file set); the worker entry rebuilds an equal WorkerConfig, after pickling as Ray does. A
    plain dict (the RQ-VAE's config) is copied with the progress file."""
    from gti.train.ray_train import _train_loop_config

    c = _ground(fault=FaultInjection(fail_at_step=3, fail_marker=str(tmp_path / "m")))
    pf = tmp_path / "ground.progress.jsonl"
    d = _train_loop_config(c, pf)
    assert type(d) is dict and d["progress_file"] == str(pf) and d["hooks"] is c.hooks and d["val"] is c.val
    assert c.progress_file is None  # the caller's object is not changed
    back = from_loop_dict(pickle.loads(pickle.dumps(d)))
    assert back == replace(c, progress_file=str(pf))
    assert from_loop_dict(back) is back
    assert _train_loop_config({"seed": 1}, pf) == {"seed": 1, "progress_file": str(pf)}


def test_worker_config_imports_no_task_module():
    """The task modules import worker_config (for its types); it must not import them back."""
    imported = []
    for node in ast.walk(ast.parse(open(worker_config.__file__).read())):
        if isinstance(node, ast.Import):
            imported += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            imported += [node.module or ""] + [f"{node.module or ''}.{a.name}" for a in node.names]
    assert "gti.train.task.hooks_for" in imported  # the lookup it uses instead
    assert not [m for m in imported if m.rsplit(".", 1)[-1].endswith("_task")], imported


def test_a_fresh_process_finds_each_tasks_hooks_by_name_and_a_worker_unpickles_them():
    """No task module imported beforehand (a Ray Train worker's start): `build` imports the task
    by name; the config's pickle (what Ray ships) brings the same hooks back in another process
    that imported only worker_config."""
    build = ("import pickle, sys\n"
             "from gti import config as C\n"
             "from gti.train.worker_config import RlStart, WorkerConfig\n"
             "assert not [m for m in sys.modules if m.startswith('gti.train.') and m.endswith('_task')]\n"
             "c = WorkerConfig.build('rl', C.RunConfig(), 0, rl=RlStart('m', 's.safetensors', 64, 88, 3))\n"
             "from gti.train import rl_task\n"
             "assert c.hooks is rl_task.HOOKS\n"
             "sys.stdout.buffer.write(pickle.dumps(c))\n")
    blob = subprocess.run([sys.executable, "-c", build], capture_output=True, check=True).stdout
    load = ("import pickle, sys\n"
            "import gti.train.worker_config\n"
            "c = pickle.loads(sys.stdin.buffer.read())\n"
            "from gti.train import rl_task\n"
            "print(c.task, c.hooks == rl_task.HOOKS, c.hooks.step_loss is rl_task.rl_step_loss)\n")
    out = subprocess.run([sys.executable, "-c", load], input=blob, capture_output=True, check=True).stdout
    assert out.decode().split() == ["rl", "True", "True"]  # a copy of the hooks, the same functions
