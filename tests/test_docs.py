"""The documentation site: it builds with ``mkdocs build --strict``, the README's links land on built pages, the
generated references cover the parser and the schema, and a real headless browser renders the pages with the
Material theme (navigation, code blocks, tables)."""

from __future__ import annotations

import functools
import http.server
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built once for this module with the command ``make docs`` runs (strict: any warning fails)."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                          str(ROOT / "mkdocs.yml"), "--site-dir", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    return out


def docs_hooks():
    """docs/hooks.py, the MkDocs hook that generates the references (loaded by path, as MkDocs loads it)."""
    spec = importlib.util.spec_from_file_location("torsh_docs_hooks", DOCS / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def page_of(site: Path, doc: str) -> Path:
    """The built HTML of a docs/ Markdown file (directory URLs: docs/a/b.md -> site/a/b/index.html)."""
    rel = Path(doc)
    if rel.name in ("index.md", "README.md"):
        return site / rel.parent / "index.html"
    return site / rel.with_suffix("") / "index.html"


def test_site_builds_strict_with_every_page_of_the_nav(site):
    for doc in ("index.md", "getting-started.md", "guides/deepspeed.md", "guides/accelerate.md", "guides/fsdp.md",
                "guides/horovod.md", "guides/launchers.md", "guides/torchtitan-torchtune.md", "guides/lightning.md",
                "torsh-run.md", "engine.md", "checkpoints.md", "scaling-out.md", "compression.md", "parity.md",
                "consumers.md", "benchmarks.md", "reference/cli.md", "reference/config.md", "architecture.md"):
        assert page_of(site, doc).is_file(), doc
    assert (site / "parity_zero3_bf16.png").is_file()  # the image the README and the parity page show


def test_every_readme_link_to_a_docs_page_resolves(site):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\((docs/[^)#\s]+)(?:#([^)\s]+))?\)", readme)
    pages = [(path, anchor) for path, anchor in links if path.endswith(".md")]
    assert len({p for p, _ in pages}) >= 15, pages  # every section of the site is linked from the front page
    for path, anchor in pages:
        assert (ROOT / path).is_file(), path
        built = page_of(site, path.removeprefix("docs/"))
        assert built.is_file(), f"{path} is not a page of the built site"
        if anchor:
            assert f'id="{anchor}"' in built.read_text(encoding="utf-8"), f"{path}#{anchor}: no such heading"
    for path, _ in links:  # images and other files
        assert (ROOT / path).is_file(), path
    assert len(readme.splitlines()) <= 200


def test_benchmark_page_includes_the_latest_results_file(site):
    html = page_of(site, "benchmarks.md").read_text(encoding="utf-8")
    first = (ROOT / "benchmarks" / "results" / "latest.md").read_text(encoding="utf-8").split("(", 1)[0]
    assert first.strip() and first.strip().split(" on ")[0] in html  # "Measured <date>" from the file
    assert "<table>" in html


def test_cli_reference_lists_every_subcommand_and_option_of_the_parser(site):
    hooks = docs_hooks()
    from torsh.cli import build_parser

    parser = build_parser()
    commands = hooks.subcommands(parser)
    assert {"convert", "validate", "explain", "diff", "launch", "parity", "merge"} <= set(commands)
    html = page_of(site, "reference/cli.md").read_text(encoding="utf-8")
    for name, sub in commands.items():
        assert f'id="cli-{name}"' in html, name
        for action in sub._actions:  # noqa: SLF001 - every option the parser takes is documented
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"<code>{flag}</code>" in html, f"{name} {flag}"


def test_config_reference_lists_every_section_and_key_of_the_schema(site):
    from torsh.schemas import load

    schema = load("torsh")
    html = page_of(site, "reference/config.md").read_text(encoding="utf-8")
    defs = schema["$defs"]
    for section, prop in schema["properties"].items():
        assert f'id="config-{section}"' in html, section
        ref = prop.get("$ref") or next((o.get("$ref") for o in prop.get("anyOf", []) if "$ref" in o), None)
        if ref:
            for key in defs[ref.rsplit("/", 1)[-1]].get("properties", {}):
                assert f"<code>{section}.{key}</code>" in html, f"{section}.{key}"


def test_the_references_refuse_to_publish_an_empty_page(monkeypatch):
    import argparse

    hooks = docs_hooks()
    import torsh.cli
    import torsh.schemas

    monkeypatch.setattr(torsh.cli, "build_parser", lambda: argparse.ArgumentParser(prog="torsh-migrate"))
    with pytest.raises(RuntimeError, match="no sub-commands"):
        hooks.cli_reference()
    monkeypatch.setattr(torsh.schemas, "load", lambda dialect: {})
    with pytest.raises(RuntimeError, match="no sections"):
        hooks.config_reference()
    page = "# CLI\n\n<!-- generated: cli-reference -->\n"
    monkeypatch.undo()
    assert "<!-- generated" not in hooks.on_page_markdown(page, None, None, None)


# ---- a real browser ------------------------------------------------------------------------------------------


def chromium() -> str:
    """Debian's chromium, installed when absent (.ci/run does the same); a skip says why it could not be."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found:
            return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("no chromium on PATH, and apt-get cannot install it here (not root, or no apt-get)")
    steps = (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"])
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, timeout=900,
                              env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})  # fmt: skip
        if done.returncode != 0:
            pytest.skip(f"chromium could not be installed ({' '.join(step)}: {done.stderr.strip()[-300:]})")
    found = shutil.which("chromium")
    if not found:
        pytest.skip("apt-get installed chromium, but no chromium is on PATH")
    return found


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # noqa: ARG002
        pass


@pytest.fixture(scope="module")
def served(site):
    """The built site over HTTP on 127.0.0.1 (a free port), as a reader's browser gets it."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def browse(url: str, profile: Path, *args: str) -> subprocess.CompletedProcess:
    command = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
               f"--user-data-dir={profile}", "--window-size=1280,900", *args, url]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("page", ["", "guides/deepspeed/"])
def test_a_headless_browser_renders_the_page_with_navigation_code_and_tables(served, tmp_path, page):
    shot = tmp_path / "page.png"
    dom = browse(f"{served}/{page}", tmp_path / "profile", "--dump-dom", f"--screenshot={shot}")
    assert dom.returncode == 0 and shot.is_file(), dom.stderr[-2000:]
    html = dom.stdout
    assert 'class="md-header' in html and "md-nav" in html  # Material's header and navigation
    nav = html[html.index('class="md-nav'):]
    for title in ("Getting started", "Migration guides", "DeepSpeed", "CLI (torsh-migrate)", "Benchmark results"):
        assert title in nav, f"{title} is not in the navigation"
    assert re.search(r"<pre[^>]*>.*?<code", html, re.S), "no code block"
    assert "<table" in html, "no table"
    # The code blocks went through the highlighter, and Material's script ran (its focus-visible polyfill marks <html>).
    assert "highlight" in html and "js-focus-visible" in html

    from PIL import Image

    with Image.open(shot) as image:
        assert image.size == (1280, 900)
        rgb = image.convert("RGB")
        header = rgb.getpixel((640, 10))  # Material's header bar, in the theme's primary colour (deep orange)
        body = rgb.getpixel((640, 450))
        colours = len(rgb.getcolors(maxcolors=1280 * 900))
    assert header[0] > 200 and header[2] < 120, f"header pixel {header}: the theme's stylesheet did not apply"
    assert body != header and colours > 50, "the page looks blank"
