"""One import root: the wheel installs the top-level package ``mmcache`` and nothing else (the
folders ``shared/``, ``processor/``, ... land as ``mmcache.shared``, ``mmcache.processor``, ...),
and the installed package imports and runs from outside the repository."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGE_DIR: dict[str, str] = PYPROJECT["tool"]["setuptools"]["package-dir"]
NOT_BUILT = shutil.ignore_patterns(
    ".venv", ".git", "__pycache__", "build", "dist", "*.egg-info", ".*_cache", "tests", "results"
)


def test_every_mapped_folder_is_reachable_as_mmcache_dot_name_in_the_checkout():
    """The build maps each folder under ``mmcache``; the symlinks give the checkout the same
    names, so tests, mypy and editors import what the wheel installs."""
    for package, folder in PACKAGE_DIR.items():
        if package == "mmcache":
            continue
        link = ROOT / "mmcache" / package.removeprefix("mmcache.")
        assert link.is_symlink() and link.resolve() == (ROOT / folder).resolve(), package
        assert set(PYPROJECT["tool"]["setuptools"]["packages"]) >= {package}


def test_the_docker_image_gets_every_mapped_folder():
    dockerfile = (ROOT / "Dockerfile").read_text()
    ignored = (ROOT / ".dockerignore").read_text().split()
    for folder in PACKAGE_DIR.values():
        assert f"COPY {folder} ./{folder}" in dockerfile, folder
        assert folder not in ignored, folder


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of the checkout (the build leaves nothing in the repo)."""
    src = tmp_path_factory.mktemp("src") / "mmcache"
    shutil.copytree(ROOT, src, symlinks=True, ignore=NOT_BUILT)
    out = tmp_path_factory.mktemp("wheel")
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    subprocess.run([*build, "-w", str(out), str(src)], check=True, timeout=300)
    (path,) = out.glob("mmcache-*.whl")
    return path


def test_the_wheel_holds_one_top_level_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == {"mmcache"}
    for package in PACKAGE_DIR:
        assert f"{package.replace('.', '/')}/__init__.py" in names, package
    assert "mmcache/shared/config.py" in names and "mmcache/llm_stage/engine.py" in names


def test_the_installed_wheel_imports_and_runs_outside_the_checkout(wheel, tmp_path):
    """A fresh venv (no pip, no dependencies of its own: a .pth lends it this environment's, so
    torch is not installed again), the wheel installed with --no-deps, run from elsewhere."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    # NOTE: a plain path line: the lent directory's own .pth files (an editable install's finder)
    # are not run, so nothing there can stand in for the installed package.
    (site / "lent-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
        check=True,
        timeout=300,
    )
    installed = {p.name for p in site.iterdir()} - {"lent-dependencies.pth"}
    assert {n for n in installed if not n.endswith((".dist-info", ".pth")) and n != "__pycache__"} == {
        "mmcache"
    }
    away = tmp_path / "elsewhere"
    away.mkdir()
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path)}
    probe = (
        "import mmcache.shared.config as c, mmcache.cli, mmcache.llm_stage.engine, mmcache.benchmarks;"
        "print(c.__file__)"
    )
    out = subprocess.run([python, "-c", probe], cwd=away, env=env, capture_output=True, text=True, timeout=99)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).is_relative_to(site / "mmcache" / "shared")
    for name in ("shared", "processor", "encoder_stage", "llm_stage", "benchmarks"):
        gone = subprocess.run([python, "-c", f"import {name}"], cwd=away, env=env, capture_output=True)
        assert gone.returncode != 0, f"top-level {name} is importable"
    out = subprocess.run(
        [venv / "bin" / "mmcache", "--help"], cwd=away, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and "serve" in out.stdout, out.stderr
