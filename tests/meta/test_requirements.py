"""requirements.txt resolves on public PyPI for the machines students have.

pip resolves only for the machine it runs on, and on the lab machines its config adds local wheel
indexes that can hide a resolution failing everywhere else (as `torch==2.13.0` with
`triton==3.9.0` does: that torch requires triton 3.7.1 on Linux, and triton has no macOS or Windows
wheels). ``uv pip compile`` resolves for any platform and Python version without installing
anything; here it sees public PyPI only: ``--index-url`` given, ``--no-config`` (no uv.toml),
no UV_*/PIP_* variables (uv never reads pip's config files). ``--no-build``: every package must come
as a wheel, as nothing should have to be compiled on a student's machine (and building for another
platform than this one could not be checked here anyway). Needs the network.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

# needs the network (uv resolves on PyPI): not in make test-fast; one xdist worker runs every
# combination, so the module fixture resolves them once (on two workers it ran twice: 20-40 s)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("pypi")]

ROOT = Path(__file__).resolve().parents[2]
INDEX = "https://pypi.org/simple"
PYTHONS = ("3.10", "3.11", "3.12", "3.13")   # pyproject's requires-python, up to the newest
PLATFORMS = {                            # name: (uv --python-platform, MACOSX_DEPLOYMENT_TARGET)
    "linux-x86_64": ("x86_64-manylinux_2_28", None),     # glibc >= 2.28, as torch's own wheels
    "linux-aarch64": ("aarch64-manylinux_2_28", None),
    "macos-arm64": ("aarch64-apple-darwin", "14.0"),     # torch >= 2.12 ships for macOS 14+ only
    "windows-x86_64": ("x86_64-pc-windows-msvc", None),
}
TRITON_WHEELS = {"linux-x86_64", "linux-aarch64"}       # triton publishes no other wheels
COMBOS = [(plat, py) for plat in PLATFORMS for py in PYTHONS]
TIMEOUT_S = 300


def uv_command() -> str:
    try:
        from uv import find_uv_bin       # the `uv` package from requirements.txt
        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        pass
    found = shutil.which("uv")
    if not found:
        pytest.fail("uv is not installed: it is in requirements.txt (`pip install uv`)")
    return found


def compile_requirements(uv: str, plat: str, py: str) -> tuple[subprocess.CompletedProcess, float]:
    target, macos = PLATFORMS[plat]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("UV_", "PIP_")) and k != "MACOSX_DEPLOYMENT_TARGET"}
    if macos:
        env["MACOSX_DEPLOYMENT_TARGET"] = macos
    cmd = [uv, "pip", "compile", "requirements.txt", "--python-platform", target,
           "--python-version", py, "--index-url", INDEX, "--no-config", "--no-build",
           "--no-python-downloads", "--no-header", "--no-annotate"]
    t = time.perf_counter()
    for _ in range(2):    # uv killed by a signal (a SIGSEGV after "Resolved", once in 16): again
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=TIMEOUT_S)
        if r.returncode >= 0:
            break
    return r, time.perf_counter() - t


@pytest.fixture(scope="module")
def resolutions():
    """All combinations, resolved in parallel (each takes seconds, mostly waiting on PyPI)."""
    try:
        urllib.request.urlopen(urllib.request.Request(f"{INDEX}/uv/", method="HEAD"), timeout=30)
    except OSError as e:
        pytest.fail(f"cannot reach {INDEX} ({e}): this test resolves requirements.txt against "
                    "public PyPI and needs the network")
    uv = uv_command()
    with ThreadPoolExecutor(max_workers=len(COMBOS)) as pool:
        futures = {c: pool.submit(compile_requirements, uv, *c) for c in COMBOS}
        return {c: f.result() for c, f in futures.items()}


def pins(output: str) -> dict[str, Version]:
    return {m[1].lower(): Version(m[2])
            for m in re.finditer(r"^([A-Za-z0-9_.-]+)==(\S+)$", output, re.MULTILINE)}


def requirement(name: str) -> Requirement:
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and Requirement(line).name == name:
            return Requirement(line)
    raise AssertionError(f"{name} is not in requirements.txt")


@pytest.mark.parametrize("plat,py", COMBOS, ids=[f"{p}-py{v}" for p, v in COMBOS])
def test_resolves_on_public_pypi(resolutions, plat, py):
    r, took = resolutions[plat, py]
    print(f"{plat} py{py}: {took:.1f} s")
    assert r.returncode == 0, (
        f"requirements.txt does not resolve on public PyPI for {plat}, Python {py}:\n{r.stderr}")
    got = pins(r.stdout)
    print({k: str(got[k]) for k in ("torch", "triton") if k in got})
    assert got["torch"] in requirement("torch").specifier
    assert "transformers" in got and "uv" in got
    if plat in TRITON_WHEELS:
        assert got["triton"] in requirement("triton").specifier
    else:
        assert "triton" not in got, f"triton has no wheel for {plat} but was resolved"


def test_tested_pythons_match_pyproject():
    import tomllib
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    oldest = re.fullmatch(r">=\s*(3\.\d+)", spec.strip())
    assert oldest, f"requires-python {spec!r}: update PYTHONS here to match"
    assert PYTHONS[0] == oldest[1], f"requires-python is {spec}; the oldest tested is {PYTHONS[0]}"
