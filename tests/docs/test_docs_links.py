"""The documentation's links resolve, and no page points outside the repository.

For README.md and every Markdown file under docs/: every relative link or image (``[text](path)``,
``[text](path#anchor)``, ``![alt](path)``; not inside code) names an existing file inside the repository, and an
anchor names a heading of the target page (GitHub's slug rule: lower case, punctuation dropped, spaces to ``-``,
``-1``, ``-2``, ... for repeats). No page mentions a path outside the repository (``../shared``, ``/work/``) or
an issue number of the project's tracker (``issue 12``), which a reader of the repository does not have.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Link targets that a branch merged alongside this one creates (the lead's architecture page, the benchmarks page
#: moved by the benchmark harness's branch). A link to one of them passes only while it is missing;
#: ``test_pending_entries_are_still_pending`` fails once it exists, so the entry gets removed.
PENDING_TARGETS: set[str] = set()
#: Pages another branch moves or rewrites (as docs/benchmarks.md became docs/results/benchmarks.md): not checked
#: while they exist here; the test below fails once they are gone, so the entry gets removed.
PENDING_SOURCES: set[str] = set()

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.I)
_OUTSIDE = re.compile(r"\.\./shared|/work/")
_ISSUE = re.compile(r"\bissues?[\s-]*#?\d+", re.I)


def doc_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [f for f in files if f.relative_to(ROOT).as_posix() not in PENDING_SOURCES]


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code spans (links there are not rendered)."""
    return _CODE.sub("", _FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: ``engine.attach(optimizer)`` in backticks -> ``engineattachoptimizer``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading keeps its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    text = _FENCE.sub("", path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    out = set(_HTML_ANCHOR.findall(text))
    for _, heading in _HEADING.findall(text):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """``'target: why'`` for every relative link of ``path`` (a page of the repository at ``root``) that does not
    resolve."""
    bad = []
    for target in _LINK.findall(_prose(path.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        try:
            rel = dest.relative_to(root).as_posix()
        except ValueError:
            bad.append(f"{target}: outside the repository")
            continue
        if not dest.exists():
            if rel not in PENDING_TARGETS:
                bad.append(f"{target}: no such file ({rel})")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading with anchor #{anchor} in {rel}")
    return bad


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(path: Path) -> None:
    bad = broken_links(path)
    assert not bad, f"{path.relative_to(ROOT)} has broken links:\n" + "\n".join(bad)


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_paths_outside_the_repository_or_issue_numbers(path: Path) -> None:
    found = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        found += [f"line {i}: {m.group(0)!r}" for m in (*_OUTSIDE.finditer(line), *_ISSUE.finditer(line))]
    assert not found, (f"{path.relative_to(ROOT)} cites what a reader of the repository does not have (cite papers "
                       "by title, authors and arXiv id; describe the change instead of an issue number):\n"
                       + "\n".join(found))


def test_pending_entries_are_still_pending() -> None:
    created = sorted(t for t in PENDING_TARGETS if (ROOT / t).exists())
    gone = sorted(s for s in PENDING_SOURCES if not (ROOT / s).exists())
    assert not created and not gone, (
        f"remove these entries from tests/docs/test_docs_links.py: targets that exist now {created}, pages that were "
        f"moved away {gone}")


def test_the_checker_catches_what_it_should(tmp_path: Path) -> None:
    """The checker itself: a missing file, a missing anchor and a link out of the repository are reported; links
    inside code, external links, repeated headings and anchors on the same page are not."""
    assert slug("`engine.attach(optimizer)`") == "engineattachoptimizer"
    assert slug("Loss reduction, gradient accumulation, empty batches") == (
        "loss-reduction-gradient-accumulation-empty-batches")
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# Top\n", encoding="utf-8")
    (tmp_path / "outside.md").write_text("# Out\n", encoding="utf-8")
    page = tmp_path / "docs" / "page.md"
    page.write_text("# A\n## B c\n## B c\n[ok](#b-c-1) [ok](../README.md#top) [ok](https://x.org/y) "
                    "`[no](nowhere.md)`\n```\n[no](nowhere.md)\n```\n[bad](nowhere.md) [bad](../README.md#nope) "
                    "[bad](#b-c-2) ![bad](img/x.png)\n", encoding="utf-8")
    bad = broken_links(page, root=tmp_path)
    assert [b.split(": ")[0] for b in bad] == ["nowhere.md", "../README.md#nope", "#b-c-2", "img/x.png"], bad
    assert broken_links(page, root=tmp_path / "docs")[0].startswith("#b-c-2") is False  # README.md is outside
    assert any("outside the repository" in b for b in broken_links(page, root=tmp_path / "docs"))
    assert _ISSUE.search("see issue 12") and _ISSUE.search("Issue #5") and _ISSUE.search("the issue-12 changes")
    assert not _ISSUE.search("github.com/pytorch/opacus/issues/567") and _OUTSIDE.search("see ../shared/papers")
