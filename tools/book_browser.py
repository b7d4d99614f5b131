"""The built book in headless Chromium with no network: the html folder served over local HTTP,
and the scripts its pages load from a CDN (MathJax, require.js, the widget manager) served from
the same versions' npm packages, fetched once with `npm pack` into a cache folder.

One implementation for the two readers of the build, the browser test (tests/test_browser.py)
and the PDF (tools/book_pdf.py), so that the PDF prints the pages the test measured, and neither
depends on a CDN answering (CI has no other network than the package registries).
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import mimetypes
import os
import re
import shutil
import subprocess
import tarfile
import threading
from pathlib import Path

# Debian's `chromium` (.ci/run installs it); $CHROMIUM, or a runner's own Chrome, otherwise.
CHROMIUM = (os.environ.get("CHROMIUM") or shutil.which("chromium")
            or shutil.which("chromium-browser") or shutil.which("google-chrome")
            or "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]

# CDN addresses the built pages use, as (npm package, version, path inside the package).
NPM_URL = re.compile(r"^https://(?:cdn\.jsdelivr\.net|unpkg\.com)/npm/"
                     r"(?P<pkg>(?:@[^/@]+/)?[^/@]+)@(?P<version>[^/]+)/(?P<path>.+)$")
REQUIRE_URL = re.compile(r"^https://cdnjs\.cloudflare\.com/ajax/libs/require\.js/"
                         r"(?P<version>[^/]+)/require(?:\.min)?\.js$")
LOCAL = "http://127.0.0.1"


@functools.cache
def npm_package(cache: Path, pkg: str, version: str) -> Path:
    """The unpacked npm package ``pkg@version`` (``npm pack``, kept under ``cache``)."""
    dest = cache / f"{pkg.replace('/', '+')}@{version}"
    if not dest.exists():
        cache.mkdir(parents=True, exist_ok=True)
        tgz = subprocess.run(["npm", "pack", "--silent", f"{pkg}@{version}",
                              "--pack-destination", str(cache)],
                             capture_output=True, text=True, check=True).stdout.split()[-1]
        with tarfile.open(cache / tgz) as tar:
            tar.extractall(dest, filter="data")
        (cache / tgz).unlink()
    return dest / "package"


def cdn_file(url: str, cache: Path) -> Path | None:
    """The local copy of a CDN url, or None for a url this module does not know."""
    if m := REQUIRE_URL.match(url):
        return npm_package(cache, "requirejs", m["version"]) / "require.js"
    if m := NPM_URL.match(url.split("?")[0]):
        return npm_package(cache, m["pkg"], m["version"]) / m["path"]
    return None


@contextlib.contextmanager
def serve(folder: Path):
    """``folder`` over HTTP on a free local port, for as long as the block runs: its address."""
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(folder))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"{LOCAL}:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()


def route_offline(page, cache: Path, unknown: list[str] | None = None) -> None:
    """Serve ``page``'s requests from the local server and the CDN cache; abort any other, and
    list in ``unknown`` the scripts, styles and fetches it aborted."""
    def route(r):
        url = r.request.url
        if url.startswith(LOCAL) and r.request.resource_type == "document":
            # A local copy is not the CDN's byte for byte: drop the integrity hashes of the
            # scripts served locally, or the browser refuses them.
            html = r.fetch().text()
            html = re.sub(r'<script[^>]*src="https://[^>]*>',
                          lambda tag: re.sub(r' integrity="[^"]*"', "", tag[0]), html)
            return r.fulfill(body=html, content_type="text/html")
        if url.startswith(LOCAL):
            return r.continue_()
        local = cdn_file(url, cache)
        if local is not None and local.is_file():
            return r.fulfill(path=str(local),
                             content_type=mimetypes.guess_type(local.name)[0] or "text/plain")
        if unknown is not None and r.request.resource_type in ("script", "stylesheet", "xhr", "fetch"):
            unknown.append(url)
        return r.abort()

    page.route("**/*", route)


def typeset(page) -> None:
    """Wait until MathJax (if the page loads it) has typeset every formula."""
    page.wait_for_function("!window.MathJax || !MathJax.startup || MathJax.startup.promise")
    page.evaluate("() => window.MathJax && MathJax.startup && MathJax.startup.promise")
