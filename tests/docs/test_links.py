"""Every relative link of the pages resolves: the file exists, and an anchor names a heading of
the page it points to (GitHub's slugs). External links are not fetched."""

from __future__ import annotations

import posixpath
from pathlib import Path

import pytest

from tests.docs.doc_blocks import LINK_PAGES, REPO, anchors, links, pages, slug


def broken_links(page: str) -> list[str]:
    """`page:line: target (why)` for each relative link of `page` that does not resolve."""
    out = []
    for line, target in links(page):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        if path:
            resolved = posixpath.normpath(posixpath.join(posixpath.dirname(page), path))
            where = REPO / resolved
            if resolved.startswith("../") or not where.exists():
                out.append(f"{page}:{line}: {target} (no such file: {resolved})")
                continue
        else:
            resolved, where = page, REPO / page
        if anchor:
            if where.is_dir() or where.suffix != ".md":
                out.append(f"{page}:{line}: {target} (an anchor into {resolved}, which is not a page)")
            elif anchor not in anchors(resolved):
                out.append(f"{page}:{line}: {target} (no heading of {resolved} has the anchor #{anchor})")
    return out


@pytest.mark.parametrize("page", pages(LINK_PAGES))
def test_every_relative_link_resolves(page):
    assert not broken_links(page), "\n".join(broken_links(page))


def test_the_pages_are_found_and_link_to_each_other():
    found = pages(LINK_PAGES)
    assert {"README.md", "docs/README.md", "docs/config.md", "bench/README.md"} <= set(found), found
    targets = {t.partition("#")[0] for _, t in links("docs/README.md")}
    docs = {Path(p).name for p in found if p.startswith("docs/") and p != "docs/README.md"}
    assert docs <= targets, f"docs/README.md does not link to {sorted(docs - targets)}"


def test_a_broken_file_or_anchor_is_found(tmp_path, monkeypatch):
    """The checker itself: a missing file, a missing anchor, an anchor into a non-page, and
    links that are fine (relative, with GitHub's slug of a heading with code and punctuation)."""
    import tests.docs.test_links as mod
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text(
        "# Title\n\n## The CPU BLAS (`device.cpu_blas=mkl`)\n\n## Repeated\n\n## Repeated\n\n"
        "[ok](#the-cpu-blas-devicecpu_blasmkl) [ok2](#repeated-1) [ok3](../top.md#top) "
        "[web](https://example.invalid/x#y)\n"
        "[gone](missing.md) [bad](#no-such-heading) [bad2](../top.md#nope)\n"
        "```bash\n[not a link](inside-code.md)\n```\n"
        "[dir](../sub#x) `[code](spans.md)`\n")
    (tmp_path / "top.md").write_text("# Top\n")
    (tmp_path / "sub").mkdir()
    monkeypatch.setattr(mod, "REPO", tmp_path)
    import tests.docs.doc_blocks as blocks_mod
    monkeypatch.setattr(blocks_mod, "REPO", tmp_path)
    found = broken_links("docs/a.md")
    assert [f.split(": ", 1)[1].split(" (")[0] for f in found] == [
        "missing.md", "#no-such-heading", "../top.md#nope", "../sub#x"], found


def test_slugs_follow_github():
    assert slug("Memory per rank, and data larger than it (`bench_stream.py`)") == \
        "memory-per-rank-and-data-larger-than-it-bench_streampy"
    assert slug("Launching across nodes with `mpiexec` / `mpirun`") == \
        "launching-across-nodes-with-mpiexec--mpirun"
    assert slug("1. End to end vs PyTorch DDP") == "1-end-to-end-vs-pytorch-ddp"
