"""`make lab`'s command line (a dry run: `make -n` prints the recipes, runs none of them, so
`setup` installs nothing): JupyterLab refuses to start as root without `--allow-root`."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def lab_command(env: dict | None = None) -> str:
    out = subprocess.run(["make", "-n", "lab"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    lines = [line for line in out.stdout.splitlines() if "jupyter lab" in line]
    assert len(lines) == 1, out.stdout
    return lines[0]


def test_make_lab_allows_root_only_as_root():
    assert ("--allow-root" in lab_command().split()) == (os.geteuid() == 0)


@pytest.mark.parametrize("uid, allowed", [("0", True), ("1000", False)])
def test_make_lab_asks_the_user_id(tmp_path, uid, allowed):
    """Whoever runs it: an `id` that answers ``uid`` decides the flag."""
    (tmp_path / "id").write_text(f"#!/bin/sh\necho {uid}\n")
    (tmp_path / "id").chmod(0o755)
    env = dict(os.environ, PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    command = lab_command(env).split()
    assert ("--allow-root" in command) == allowed
    assert command[-1] == "notebooks/"
