"""The README and docs/ cannot rot quietly: every relative link and anchor resolves, every `make` target, `python -m`
module and repository path named in their code exists, code quoted from examples/ is what the example runs, and the
public API a newcomer reads first has docstrings."""
from __future__ import annotations

import importlib.util
import inspect
import re
from pathlib import Path

import pytest

import engine
from engine.serving import client

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
SPAN = re.compile(r"`([^`\n]+)`")
QUOTED = re.compile(r"<!-- from (\S+) -->\n```[^\n]*\n(.*?)^```", re.S | re.M)
PATH = re.compile(r"(?<![\w/.~-])((?:examples|perf|scripts|engine|tests|deploy|client|model_repository|docs)"
                  r"/[\w./*<>{}-]*[\w/*>}])")


def ids(pages):
    return [str(p.relative_to(ROOT)) for p in pages]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def code(page: Path) -> list[str]:
    """The page's code: fenced blocks and inline spans."""
    text = page.read_text()
    return FENCE.findall(text) + SPAN.findall(FENCE.sub("", text))


def make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))


def module_exists(name: str) -> bool:
    parts = name.split(".")
    if (ROOT / parts[0]).is_dir():
        base = ROOT.joinpath(*parts)
        return base.with_suffix(".py").is_file() or (base / "__main__.py").is_file()
    return importlib.util.find_spec(parts[0]) is not None


def path_exists(path: str) -> bool:
    """A file or folder of the tree; a pattern (`cpu_*.cpp`), an output (`perf/results/...`) and a module's attribute
    (`perf/bench_gguf.agreement`) are let through."""
    if any(c in path for c in "*<>{}") or path.startswith("perf/results"):
        return True
    return (ROOT / path).exists() or (ROOT / path).with_suffix(".py").is_file()


@pytest.mark.parametrize("page", PAGES, ids=ids(PAGES))
def test_links_and_anchors_resolve(page):
    broken = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, broken


@pytest.mark.parametrize("page", PAGES, ids=ids(PAGES))
def test_commands_and_paths_exist(page):
    targets, missing = make_targets(), []
    for snippet in code(page):
        missing += [f"make {t}" for t in re.findall(r"(?:^|[\s;&(])make ([a-z][\w-]*)", snippet, re.M)
                    if t not in targets]
        missing += [f"python -m {m}" for m in re.findall(r"python3? -m ([\w.]+)", snippet)
                    if not m.split(".")[-1].isupper() and not module_exists(m)]
        missing += [p for p in PATH.findall(snippet) if not path_exists(p)]
    assert not missing, missing


def test_quoted_code_is_the_examples_code():
    quoted = [(page, src, block) for page in PAGES for src, block in QUOTED.findall(page.read_text())]
    assert quoted, "the README quotes its examples with <!-- from examples/NAME.py -->"
    for page, src, block in quoted:
        lines = [ln.rstrip() for ln in (ROOT / src).read_text().splitlines()]
        want = [ln.rstrip() for ln in block.splitlines()]
        assert any(lines[i:i + len(want)] == want for i in range(len(lines))), f"{page.name}: not in {src}: {want}"


def test_readme_is_a_landing_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; its detail belongs in docs/"
    linked = {Path(t.partition("#")[0]).name for t in LINK.findall("\n".join(lines)) if t.startswith("docs/")}
    assert {p.name for p in (ROOT / "docs").glob("*.md")} <= linked


def documented(obj) -> bool:
    doc = inspect.getdoc(obj) or ""
    return bool(doc) and not doc.startswith(f"{getattr(obj, '__name__', '')}(")     # not the dataclass default


def test_public_names_have_docstrings():
    names = [getattr(engine, n) for n in engine.__all__]
    names += [client.EngineClient, client.make_client]
    names += [getattr(engine.LLM, "generate")]
    names += [getattr(client.EngineClient, m) for m in ("submit", "abort", "shutdown", "generate")]
    assert [getattr(n, "__qualname__", n) for n in names if not documented(n)] == []
