"""Notebook 05 in a real browser: JupyterLab on localhost, headless Chromium driven by Selenium.

Opens ``05_fragmentation_visualizer.ipynb``, runs all cells, screenshots the visualizer's figure,
switches the allocator dropdown, and checks that the figure the kernel redraws is different. Then
presses the time slider's ▶: the figure must advance while it plays and stop advancing within a
second of ■ (no backlog of frames drawn after the user stopped).
Needs Debian's ``chromium`` and ``chromium-driver`` (``apt-get install -y chromium
chromium-driver``) and the ``selenium`` package; without them this test fails, it never skips.
Screenshots land in ``$MINILLM_BROWSER_SHOTS`` (default: the test's tmp folder).
"""
from __future__ import annotations

import io
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = "05_fragmentation_visualizer.ipynb"
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
TOKEN = "minillm-browser-test"

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def lab(tmp_path):
    """JupyterLab serving a temporary copy of notebooks/ (running cells in the browser must never
    write outputs into the repository), with the app exposed as ``window.jupyterapp``."""
    root = tmp_path / "notebooks"
    shutil.copytree(ROOT / "notebooks", root, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    port = free_port()
    env = {**os.environ, "MINILLM_QUICK": "1", "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
           "JUPYTER_CONFIG_DIR": str(tmp_path / "config")}
    log = open(tmp_path / "jupyterlab.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ip=127.0.0.1",
         f"--port={port}", f"--ServerApp.root_dir={root}", f"--IdentityProvider.token={TOKEN}",
         "--ServerApp.password=", "--LabApp.expose_app_in_browser=True",
         f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}",
         f"--LabApp.user_settings_dir={tmp_path / 'settings'}"],
        cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/status?token={TOKEN}", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    log.flush()
                    pytest.fail("JupyterLab did not start:\n" + (tmp_path / "jupyterlab.log").read_text()[-3000:])
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture
def browser():
    if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
        pytest.fail(f"{CHROMIUM} or {CHROMEDRIVER} is missing: "
                    "apt-get update && apt-get install -y chromium chromium-driver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail("the selenium package is missing: pip install selenium")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--no-first-run", "--window-size=1400,1800"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(what: str, fn, timeout: float, poll: float = 0.5):
    deadline = time.time() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.time() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


NOTEBOOK_STATE = """
const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
if (!w || !w.content || !w.sessionContext || !w.sessionContext.session) return null;
const cells = w.content.widgets.filter(c => c.model.type === 'code');
return {status: w.sessionContext.session.kernel ? w.sessionContext.session.kernel.status : 'none',
        executed: cells.filter(c => c.model.executionCount).length, total: cells.length,
        errors: cells.filter(c => c.model.outputs.toJSON().some(o => o.output_type === 'error'))
                     .map(c => c.model.sharedModel.getSource().slice(0, 80))};
"""


def figure_png(driver) -> bytes:
    from selenium.webdriver.common.by import By
    img = driver.find_element(By.CSS_SELECTOR, ".minillm-viz-figure")
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", img)
    time.sleep(0.5)
    return img.screenshot_as_png


def figure_src(driver) -> str:
    from selenium.webdriver.common.by import By
    return driver.find_element(By.CSS_SELECTOR, ".minillm-viz-figure").get_attribute("src")


def play_button(driver, icon: str):
    """The button of the (first) visualizer's Play widget that shows font-awesome ``icon``
    (ipywidgets 8: ``fa-play`` / ``fa-pause`` on the play button, ``fa-stop`` on the stop one)."""
    from selenium.webdriver.common.by import By
    return driver.find_element(By.XPATH, "(//*[contains(concat(' ', @class, ' '), ' minillm-viz-play ')]"
                               f"//button[.//i[contains(concat(' ', @class, ' '), ' {icon} ')]])[1]")


def settled(driver, ref: list) -> bool:
    """True once the figure has not changed for 2 s; ``ref`` = [last src, since when]."""
    now = figure_src(driver)
    if now != ref[0]:
        ref[0], ref[1] = now, time.time()
    return time.time() - ref[1] >= 2.0


def check_play_and_stop(driver, shots: Path) -> None:
    """▶ advances the figure; after ■ (once the frame in progress has landed) it never changes."""
    from selenium.webdriver.common.by import By
    play = play_button(driver, "fa-play")
    driver.execute_script("arguments[0].scrollIntoView({block: 'center'});", play)
    before = figure_src(driver)
    play.click()
    wait_for("the figure to advance while playing", lambda: figure_src(driver) != before, 20, poll=0.2)
    assert driver.find_elements(By.CSS_SELECTOR, ".minillm-viz-play i.fa-pause"), \
        "▶ did not start playing"
    driver.save_screenshot(str(shots / "05_playing.png"))
    play_button(driver, "fa-stop").click()
    # The frame in progress may still land, later on a loaded machine: wait for the figure to
    # rest 2 s (a player still playing changes it every frame and never rests: that fails here)
    last = [figure_src(driver), time.time()]
    wait_for("the figure to rest after ■", lambda: settled(driver, last), 60, poll=0.1)
    stopped = last[0]
    changes, deadline = [], time.time() + 3.0
    for _ in range(60):                              # 3 s of polls, bounded in count and time
        if time.time() > deadline:
            break
        if (now := figure_src(driver)) != stopped:
            changes.append(now)
            stopped = now
        time.sleep(0.05)
    driver.save_screenshot(str(shots / "05_stopped.png"))
    assert not changes, f"the figure changed {len(changes)} times after it had rested 2 s after ■"
    assert driver.find_elements(By.CSS_SELECTOR, ".minillm-viz-play i.fa-play"), \
        "■ did not stop playing"


def test_visualizer_in_jupyterlab(lab, browser, tmp_path):
    from PIL import Image, ImageChops
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    shots = Path(os.environ.get("MINILLM_BROWSER_SHOTS", tmp_path))
    shots.mkdir(parents=True, exist_ok=True)
    browser.get(f"{lab}/lab/tree/{NOTEBOOK}?token={TOKEN}")
    wait_for("the notebook and its kernel",
             lambda: (s := browser.execute_script(NOTEBOOK_STATE)) and s["status"] == "idle", 120)
    browser.execute_script("window.jupyterapp.commands.execute('notebook:run-all-cells');")
    state = wait_for("all cells to run",
                     lambda: (s := browser.execute_script(NOTEBOOK_STATE))
                     and (s["errors"] or (s["executed"] == s["total"] and s["status"] == "idle"))
                     and s, 300, poll=1.0)
    assert not state["errors"], f"cells failed in the browser: {state['errors']}"

    wait_for("the visualizer's figure", lambda: browser.find_elements(
        By.CSS_SELECTOR, ".minillm-viz-figure[src^='blob:'], .minillm-viz-figure[src^='data:']"), 60)
    before = figure_png(browser)
    browser.save_screenshot(str(shots / "05_before.png"))
    (shots / "05_figure_before.png").write_bytes(before)
    src_before = browser.find_element(By.CSS_SELECTOR, ".minillm-viz-figure").get_attribute("src")

    select = browser.find_element(By.CSS_SELECTOR, ".minillm-viz-allocator select")
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'});", select)
    current = Select(select).first_selected_option.text
    target = "exact contiguous" if current != "exact contiguous" else "max-length reservation"
    Select(select).select_by_visible_text(target)
    wait_for("the kernel to redraw the figure", lambda: browser.find_element(
        By.CSS_SELECTOR, ".minillm-viz-figure").get_attribute("src") != src_before, 60)
    after = figure_png(browser)
    browser.save_screenshot(str(shots / "05_after.png"))
    (shots / "05_figure_after.png").write_bytes(after)

    a = Image.open(io.BytesIO(before)).convert("RGB")
    b = Image.open(io.BytesIO(after)).convert("RGB").resize(a.size)
    changed = sum(1 for px in ImageChops.difference(a, b).getdata() if max(px) > 32)
    assert a.size[0] > 400 and a.size[1] > 300, f"the figure is too small to be real: {a.size}"
    assert changed > 0.01 * a.size[0] * a.size[1], \
        f"switching the allocator to {target!r} changed only {changed} pixels of the figure"

    check_play_and_stop(browser, shots)
