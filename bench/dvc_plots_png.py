"""A PNG of the page `dvc plots show` writes, as a browser draws it (docs/dvc_plots.png, shown in docs/runs.md).

DVC's HTML loads vega, vega-lite and vega-embed from a CDN; on a machine without that network this
serves them from local copies instead (``--vega-dir``: a folder holding the npm packages' builds,
e.g. ``npm pack vega@5.20.2 vega-lite@5.2.0 vega-embed@6.18.2`` unpacked as vega/, vega-lite/,
vega-embed/ — the versions DVC's page names). Headless Chromium (Debian's ``chromium``, through
Playwright) opens the page, waits until every plot has drawn its canvas or SVG, and saves a
screenshot, shrunk to ``--width`` pixels.

    dvc plots show -o /tmp/dvc_plots       # after dvc repro
    python bench/dvc_plots_png.py /tmp/dvc_plots/index.html docs/dvc_plots.png --vega-dir /tmp/vegajs
"""

from __future__ import annotations

import argparse
import io
import re
import shutil
from pathlib import Path

PACKAGES = ("vega", "vega-lite", "vega-embed")  # DVC's <script src="https://cdn.jsdelivr.net/npm/<name>@<version>">


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("html", help="the index.html `dvc plots show -o DIR` wrote")
    ap.add_argument("png", help="where the screenshot goes")
    ap.add_argument("--vega-dir", help="local vega/, vega-lite/, vega-embed/ npm packages (default: the CDN)")
    ap.add_argument("--width", type=int, default=1400, help="the PNG's width in pixels (default 1400)")
    ap.add_argument("--columns", type=int, default=3, help="plots per row (default 3)")
    args = ap.parse_args(argv)

    from PIL import Image
    from playwright.sync_api import sync_playwright

    chromium = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    if chromium is None:
        raise SystemExit("no Chromium on PATH (Debian: apt-get install -y chromium)")
    builds = {}
    if args.vega_dir:
        for name in PACKAGES:
            js = Path(args.vega_dir) / name / "build" / f"{name}.min.js"
            if not js.is_file():
                raise SystemExit(f"{js} does not exist (unpack `npm pack {name}` there as {name}/)")
            builds[name] = js.read_bytes()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 420 * args.columns + 40, "height": 900}, device_scale_factor=1)
        if builds:
            def serve(route):
                name = re.match(r".*/npm/([a-z-]+)@", route.request.url).group(1)
                route.fulfill(body=builds[name], content_type="application/javascript")

            page.route(re.compile(r"https://cdn\.jsdelivr\.net/npm/.*"), serve)
        page.goto(Path(args.html).resolve().as_uri())
        # a grid of plots, not one long column; then wait until each has drawn
        page.add_style_tag(content=f"body {{display: grid; grid-template-columns: repeat({args.columns}, auto);}}")
        n = page.locator("body > div[id]").count()  # one per plot: vegaEmbed draws into it, or an image plot's <img>
        page.wait_for_function("[...document.querySelectorAll('body > div[id]')].every(d => d.querySelector("
                               "'img, .vega-embed canvas, .vega-embed svg'))", timeout=60_000)
        png = page.screenshot(full_page=True)
        browser.close()
    img = Image.open(io.BytesIO(png)).convert("RGB")
    img = img.resize((args.width, round(img.height * args.width / img.width)), Image.LANCZOS)
    img.quantize(colors=64).save(args.png, optimize=True)
    print(f"{args.png}: {img.width}x{img.height}, {Path(args.png).stat().st_size // 1024} KiB, {n} plots")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
