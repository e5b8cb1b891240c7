"""Executed notebooks as a person sees them: JupyterLab served on the loopback, opened in headless
Chromium through Playwright (Debian's ``chromium``; Playwright's own browser download is not used).

``browser()`` skips the calling test, with the reason, where Playwright or a Chromium is missing.
``jupyter_lab(root, tmp)`` serves ``root`` on a free port of 127.0.0.1 with a random token, every
Jupyter config, data, settings and workspace folder under ``tmp`` (nothing read from or written to
the user's), notebook windowing off (every cell rendered, not only the visible ones) and no news or
update checks. ``check_notebook(page, url, path)`` opens one notebook, waits until each figure the
file holds is rendered, and returns what it saw: the images' pixel spread (a blank image has
none), the error outputs on the page, and a screenshot.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

CHROMIUMS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
SETTINGS = {  # JupyterLab settings overrides: render every cell, no network calls, no pop-ups
    "@jupyterlab/notebook-extension:tracker": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension:notification": {"fetchNews": "false", "checkForUpdates": False},
}


def browser() -> str:
    """The Chromium to drive (skips the test, with the reason, where there is none or no Playwright)."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("Playwright is not installed (it is in the dev extra: pip install -e '.[dev]')")
    exe = next((shutil.which(name) for name in CHROMIUMS if shutil.which(name)), None)
    if exe is None:
        pytest.skip("no Chromium found on PATH (Debian: apt-get install -y chromium)")
    return exe


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def jupyter_lab(root: Path, tmp: Path, timeout_s: float = 120):
    """Serve ``root`` with JupyterLab; yields ``(base_url, token)``; stops the server after."""
    home = tmp / "jupyter"
    settings = home / "settings"
    for name, values in SETTINGS.items():
        package, plugin = name.split(":")
        (settings / package).mkdir(parents=True, exist_ok=True)
        (settings / package / f"{plugin}.jupyterlab-settings").write_text(json.dumps(values))
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(home / "config"), "JUPYTER_DATA_DIR": str(home / "data"),
           "JUPYTER_RUNTIME_DIR": str(home / "runtime"), "JUPYTERLAB_SETTINGS_DIR": str(settings),
           "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces"), "JUPYTER_PLATFORM_DIRS": "1"}
    port, token = _free_port(), secrets.token_hex(16)
    log = (tmp / "jupyter-lab.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
                             f"--ServerApp.port={port}", "--ServerApp.port_retries=0", "--ServerApp.allow_root=True",
                             f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                log.flush()
                raise AssertionError(f"jupyter lab did not start: {(tmp / 'jupyter-lab.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield base, token
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def figures_in(path: Path) -> int:
    """How many PNG figures the executed notebook holds (outputs with image/png)."""
    nb = json.loads(path.read_text())
    return sum("image/png" in out.get("data", {}) for cell in nb["cells"] for out in cell.get("outputs", []))


def errors_in(path: Path) -> list[str]:
    """The notebook file's error outputs (``ename: evalue``)."""
    nb = json.loads(path.read_text())
    return [f"{o['ename']}: {o['evalue']}" for c in nb["cells"] for o in c.get("outputs", [])
            if o["output_type"] == "error"]


# JupyterLab renders an error output as stderr text (as it renders a stream to stderr): its traceback
# or its "Name: message" line tells them apart
ERROR_TEXT = re.compile(r"Traceback \(most recent call last\)|^[A-Za-z_][\w.]*(Error|Exception|Interrupt)\b.*:", re.M)


def pixel_spread(png: bytes) -> float:
    """Standard deviation of the grey levels of a PNG (0 for a blank, one-colour image)."""
    from PIL import Image, ImageStat

    return ImageStat.Stat(Image.open(io.BytesIO(png)).convert("L")).stddev[0]


@dataclass
class Seen:
    figures: int  # <img> elements rendered in the notebook's outputs
    spreads: list[float]  # each one's pixel spread, from a screenshot of the element on the page
    error_outputs: int  # outputs rendered as errors
    screenshot: bytes  # the notebook's panel


def check_notebook(page, base: str, token: str, path: Path, rel: str, timeout_ms: float = 120_000) -> Seen:
    """Open ``rel`` (``path`` relative to the served root) in a reset workspace and wait until the
    notebook's figures are rendered: as many decoded ``<img>`` in its outputs as the file holds."""
    expected = figures_in(path)
    page.goto(f"{base}/lab/tree/{rel}?reset&token={token}", wait_until="domcontentloaded")
    panel = page.locator(".jp-NotebookPanel").first
    panel.locator(".jp-Cell").first.wait_for(timeout=timeout_ms)
    page.wait_for_function(
        """([n]) => { const im = [...document.querySelectorAll('.jp-NotebookPanel .jp-OutputArea-output img')];
                      return im.length >= n && im.every(i => i.complete && i.naturalWidth > 0); }""",
        arg=[expected], timeout=timeout_ms)
    images = panel.locator(".jp-OutputArea-output img")
    spreads = [pixel_spread(images.nth(i).screenshot()) for i in range(images.count())]  # each scrolled into view
    stderr = panel.locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]')
    errors = sum(bool(ERROR_TEXT.search(stderr.nth(i).inner_text())) for i in range(stderr.count()))
    if images.count():
        images.first.evaluate("img => img.scrollIntoView({block: 'center'})")  # the screenshot shows a figure
    return Seen(images.count(), spreads, errors, page.screenshot())


def control_notebook(path: Path) -> None:
    """A notebook with what the checks must catch: an error output and a blank (one-colour) figure."""
    import base64

    import nbformat
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (320, 200), "white").save(buf, format="PNG")
    cell = nbformat.v4.new_code_cell("1 / 0")
    cell.outputs = [nbformat.v4.new_output("display_data", data={"image/png": base64.b64encode(buf.getvalue()).decode(),
                                                                 "text/plain": "<Figure>"}),
                    nbformat.v4.new_output("error", ename="ZeroDivisionError", evalue="division by zero",
                                           traceback=["ZeroDivisionError: division by zero"])]
    nb = nbformat.v4.new_notebook(cells=[cell])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(path))
