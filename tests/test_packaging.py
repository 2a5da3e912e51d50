"""The wheel's contents: every subpackage listed, config files shipped, console script present."""

from __future__ import annotations

import tomllib
from importlib import metadata, resources
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed_in_pyproject():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "skyrl_megatron").rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    assert on_disk - listed == set(), "add these packages to [tool.setuptools].packages"


def test_config_group_ships_inside_the_package():
    conf = resources.files("skyrl_megatron.conf")
    for name in ("skyrl_megatron.yaml", "megatron/policy.yaml", "megatron/ref.yaml", "megatron/critic.yaml"):
        assert conf.joinpath(name).is_file(), name


def test_built_wheel_contains_the_config_files(tmp_path):
    import subprocess
    import sys
    import zipfile

    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("skyrl_megatron-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in ("skyrl_megatron.yaml", "megatron/policy.yaml", "megatron/ref.yaml", "megatron/critic.yaml"):
        assert f"skyrl_megatron/conf/{name}" in names
    assert "skyrl_megatron/cli.py" in names


def test_console_script_is_declared():
    scripts = {ep.name: ep.value for ep in metadata.entry_points(group="console_scripts")}
    assert scripts.get("skyrl-megatron") == "skyrl_megatron.cli:main"
