"""The project layout promises that are easy to break by accident."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_no_platform_package_shadowing_stdlib():
    # A platform/__init__.py would make `import platform` find our folder, breaking ray/torch.
    assert not (ROOT / "platform" / "__init__.py").exists()


def test_stdlib_platform_still_works_in_project_env():
    out = subprocess.run(
        [sys.executable, "-c", "import platform, gti; print(platform.system())"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )
    assert out.stdout.strip() in {"Linux", "Darwin", "Windows"}


def test_required_top_level():
    for name in ["platform/gti", "jobs", "cluster", "tests", "pyproject.toml", "ray_cluster.yaml"]:
        assert (ROOT / name).exists(), name


def test_ci_runs_the_readme_test_command():
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme


PKG = ROOT / "platform" / "gti"
PURE = ["sid", "lm", "eval", "diagnostics", "embed", "data"]
# The one module under gti/train/ that talks to Ray (the Train driver and the worker calls).
TRAIN_RAY_MODULE = "train/ray_train.py"
# The one module under gti/serve/ that talks to Ray (the Ray Serve deployment and `gti serve`).
SERVE_RAY_MODULE = "serve/deployment.py"
# The one module of `gti infer` that talks to Ray (the Ray Data actor pool); gti/serve/infer.py is pure.
INFER_RAY_MODULE = "serve/infer_ray.py"
# Every module that may import ray (a folder: all its modules): the stages and the experiments
# (the Ray shell), the three above, starting or joining Ray, and `gti doctor` reading a cluster.
RAY_MODULES = ("stages/", "experiments/", TRAIN_RAY_MODULE, SERVE_RAY_MODULE, INFER_RAY_MODULE, "ray_start.py",
               "doctor.py")


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in `path`, top-level or inside a function."""
    import ast

    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def _files(*parts: str) -> list[Path]:
    out = []
    for part in parts:
        base = PKG / part
        out += [base] if base.is_file() else sorted(base.rglob("*.py"))
    return out


def _offenders(files: list[Path], bad) -> list[str]:
    return [f"{f.relative_to(ROOT)}:{line}: {mod}" for f in files for line, mod in _imports(f) if bad(mod)]


def _is_ray(mod: str) -> bool:
    return mod == "ray" or mod.startswith("ray.")


def test_pure_modules_never_import_ray():
    """Pure building blocks and the bottom modules never import ray; under gti/train/ only the
    Train driver does, under gti/serve/ only the Serve deployment and gti infer's actor pool
    (gti/stages, gti/experiments, gti/train/ray_train.py, gti/serve/deployment.py and
    gti/serve/infer_ray.py are the Ray shell; gti/ray_start.py starts Ray for all of them)."""
    bottom = ["common", "config", "run", "cli.py", "preflight.py"]
    train = [f for f in _files("train") if f.relative_to(PKG).as_posix() != TRAIN_RAY_MODULE]
    serve = [f for f in _files("serve") if f.relative_to(PKG).as_posix() not in (SERVE_RAY_MODULE, INFER_RAY_MODULE)]
    offenders = _offenders(_files(*PURE, *bottom) + train + serve, _is_ray)
    assert not offenders, offenders


def test_only_the_listed_modules_import_ray():
    """Issue 31, item 3: ray is imported by the modules `RAY_MODULES` lists and by no other
    (starting or joining Ray is `gti.ray_start.ensure_ray`, which the others call)."""
    def listed(f: Path) -> bool:
        rel = f.relative_to(PKG).as_posix()
        return any(rel == m or (m.endswith("/") and rel.startswith(m)) for m in RAY_MODULES)

    offenders = _offenders([f for f in sorted(PKG.rglob("*.py")) if not listed(f)], _is_ray)
    assert not offenders, offenders


def _is_stage(mod: str) -> bool:
    return mod == "gti.stages" or mod.startswith("gti.stages.")


def test_a_stage_imports_no_other_stage_and_never_the_pipeline():
    """What two stages share lives in a block below them (`gti.ray_start`, `gti.run.chunked_output`,
    `gti.data.schemas`, ...), never in a stage module."""
    stages = [f for f in _files("stages") if f.name != "__init__.py"]

    def bad(mod: str) -> bool:
        return (mod in ("gti.run.pipeline", "gti.experiments") or mod.startswith(("gti.run.pipeline.", "gti.experiments."))
                or _is_stage(mod))

    offenders = _offenders(stages, bad)
    assert not offenders, offenders


def test_stage_modules_are_only_stages():
    """Issue 31, item 3: the pipeline runs the stage modules (by name, `gti.run.pipeline.STAGES`) and
    no module outside gti/stages/ imports one; above all the commands beside the pipeline,
    gti/refresh/ and gti/vocab_ground.py, reuse the blocks below the stages (the Ray helper
    included: it is `gti.ray_start`, not a stage module)."""
    drivers = _offenders(_files("refresh", "vocab_ground.py"), _is_stage)
    assert not drivers, drivers
    outside = [f for f in sorted(PKG.rglob("*.py")) if f.relative_to(PKG).parts[0] != "stages"]
    offenders = _offenders(outside, _is_stage)
    assert not offenders, offenders


def test_pure_blocks_import_neither_config_nor_manifest_nor_the_driver():
    heavy = ("gti.config", "gti.run", "gti.stages", "gti.experiments")
    offenders = _offenders(_files(*PURE), lambda m: m in heavy or m.startswith(tuple(h + "." for h in heavy)))
    assert not offenders, offenders


def test_eval_does_not_import_train():
    """Training validates with eval's decoders; evaluation never needs the training code."""
    offenders = _offenders(_files("eval"), lambda m: m == "gti.train" or m.startswith("gti.train."))
    assert not offenders, offenders


def test_every_package_module_has_a_test_module_of_the_same_name():
    """tests/ mirrors platform/gti/: gti/x/y.py is tested in tests/x/test_y.py (a leading
    underscore dropped: a gti/x/_y.py would be tested in tests/x/test_y.py)."""
    missing = []
    for f in sorted(PKG.rglob("*.py")):
        if f.name in ("__init__.py", "__main__.py"):
            continue
        rel = f.relative_to(PKG)
        want = ROOT / "tests" / rel.parent / f"test_{f.stem.lstrip('_')}.py"
        if not want.is_file():
            missing.append(f"{rel} -> {want.relative_to(ROOT)}")
    assert not missing, missing


MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 80


def test_no_module_over_450_lines_and_no_function_over_80():
    """Issue 16's size limits: a module a newcomer can read in one sitting, an entry point that
    reads like a table of contents (split long work into named steps, not into one long body)."""
    import ast

    big_modules, long_functions = [], []
    for f in sorted(PKG.rglob("*.py")):
        text = f.read_text()
        rel = f.relative_to(PKG)
        if text.count("\n") > MAX_MODULE_LINES:
            big_modules.append(f"{rel}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long_functions.append(f"{rel}:{node.lineno} {node.name}: {n} lines")
    assert not big_modules and not long_functions, big_modules + long_functions


def test_training_runs_go_through_the_runners_not_the_training_stages():
    """One runner per training task (issue 31, item 1): `gti refresh` and `gti vocab ground`
    train through `gti.train.ground_run` / `gti.train.sft_run`, never through the `ground` or
    `sft` stage modules; and gti/train/ sits below the stages, importing none of them (a caller
    hands its runner the Ray start)."""
    def training_stage(mod: str) -> bool:
        return mod in ("gti.stages.ground", "gti.stages.sft") or mod.startswith(("gti.stages.ground.",
                                                                                "gti.stages.sft."))

    offenders = _offenders(_files("refresh", "vocab_ground.py"), training_stage) + _offenders(_files("train"), _is_stage)
    assert not offenders, offenders


MAX_HEADER_LINES = 12


def test_module_headers_are_at_most_12_lines():
    """Issue 53 item 4: every module opens with a short header (what it is for, what it does not
    know, pointers to docs or bench entries), not a lab notebook; the detail of one function lives
    in that function's docstring or beside the code it explains."""
    import ast

    long_headers = []
    for f in sorted(PKG.rglob("*.py")):
        rel = f.relative_to(PKG).as_posix()
        header = ast.get_docstring(ast.parse(f.read_text()), clean=False) or ""
        n = len(header.splitlines())
        if n > MAX_HEADER_LINES:
            long_headers.append(f"{rel}: {n} lines")
    assert not long_headers, long_headers
