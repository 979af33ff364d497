"""README.md and docs/*.md as a reader uses them: every ```python block runs as printed, every
``bsr_jax.name`` they cite exists after ``import bsr_jax``, every file they link or cite exists.

A page's python blocks run in order in one fresh interpreter, sharing their names, as a reader
pastes them one after the other; a block that needs an earlier page's names fails.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = sorted(["README.md", *(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))])
# The repository's tracked top-level directories: a cited path starting with one names a file of
# ours (runs/, where training writes by default, is not one).
_TRACKED = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
TOP_DIRS = tuple(sorted({path.split("/")[0] + "/" for path in _TRACKED if "/" in path}))
SOURCE_SUFFIXES = (".py", ".md", ".cc", ".toml")


def _read(page: str) -> str:
    with open(os.path.join(ROOT, page)) as f:
        return f.read()


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def _run(code: str, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)  # fmt: skip


def test_the_pages_have_python_blocks():
    # Guards the extraction: a changed fence style would otherwise make the next test pass vacuously.
    assert python_blocks(_read("README.md")), "README.md has no ```python block"


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(_read(p))])
def test_python_blocks_run_as_printed(page):
    blocks = python_blocks(_read(page))
    # Each block is compiled under its own name, so a traceback says which block of the page failed.
    code = "\n".join(f"exec(compile({block!r}, '{page} block {i + 1}', 'exec'))" for i, block in enumerate(blocks))
    done = _run(code)
    assert done.returncode == 0, f"{page}:\n{done.stderr[-3000:]}"


def test_cited_library_names_exist_after_import_bsr_jax():
    cited = sorted({m for p in PAGES for m in re.findall(r"\bbsr_jax(?:\.[A-Za-z_]\w*)+", _read(p))})
    # A fresh interpreter: in this one, other tests may have imported submodules already.
    check = ("import bsr_jax, functools\nmissing = []\nfor name in %r:\n"
             "    try: functools.reduce(getattr, name.split('.')[1:], bsr_jax)\n"
             "    except AttributeError: missing.append(name)\nprint(missing)") % (cited,)  # fmt: skip
    done = _run(check)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


def cited_paths(text: str) -> set[str]:
    """Markdown link targets that are not URLs or anchors, and words that name a file of ours:
    starting with a top-level directory, or ending in a source suffix. Patterns and placeholders
    (``train/<class>/*.jpg``, ``runs/{name}``) are not files."""
    links = {t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"\w+:|#", t)}
    words = {w.rstrip(".,:;") for w in re.findall(r"[\w./~<>*{}-]+", text)}
    named = {w for w in words if w.startswith(TOP_DIRS) or re.search(r"\w\.(%s)$" % "|".join(s[1:] for s in SOURCE_SUFFIXES), w)}
    return {p for p in links | named if not re.search(r"[<>*{}~]", p)}


def _exists(page: str, path: str) -> bool:
    """Relative to the page or the repository root; a bare file name anywhere in the repository
    (``cifar_grid.py`` after ``benchmarks/accuracy/cifar_grid.py`` was named)."""
    here = os.path.dirname(os.path.join(ROOT, page))
    if any(os.path.exists(os.path.join(base, path)) for base in (here, ROOT)):
        return True
    return "/" not in path and bool(glob.glob(os.path.join(ROOT, "**", path), recursive=True))


@pytest.mark.parametrize("page", PAGES)
def test_cited_files_exist(page):
    missing = sorted(p for p in cited_paths(_read(page)) if not _exists(page, p))
    assert missing == [], f"{page} cites files the repository does not have"
