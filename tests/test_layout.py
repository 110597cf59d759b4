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


PURE = ["sid", "lm", "eval", "diagnostics", "embed", "data"]


def test_pure_modules_never_import_ray():
    """Pure building blocks must not import ray (only gti/stages and gti/train/loop.py do)."""
    offenders = []
    for pkg in PURE + ["config.py", "manifest.py", "pipeline.py", "cli.py", "errors.py"]:
        base = ROOT / "platform" / "gti" / pkg
        files = [base] if base.is_file() else sorted(base.rglob("*.py"))
        for f in files:
            for line in f.read_text().splitlines():
                s = line.strip()
                if s.startswith(("import ray", "from ray")):
                    offenders.append(f"{f.relative_to(ROOT)}: {s}")
    assert not offenders, offenders
