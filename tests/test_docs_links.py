"""Every relative link in README.md and docs/*.md resolves: the file exists and, for FILE#ANCHOR, FILE has a
heading whose GitHub anchor is ANCHOR (lower case, punctuation dropped, spaces to hyphens, -1, -2 for repeats)."""

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def anchors(path):
    """The GitHub anchors of a markdown file's headings (outside fenced code)."""
    seen, out, fenced = {}, set(), False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.lstrip().startswith("```"):
                fenced = not fenced
            m = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
            if m:
                slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower().replace("`", "")).replace(" ", "-")
                n = seen.get(slug, 0)
                seen[slug] = n + 1
                out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(path):
    """(line number, target) for every relative markdown link outside indented or fenced code."""
    fenced = False
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
            if fenced or line.startswith("    "):
                continue
            for m in LINK.finditer(line.replace("`", "")):
                target = m.group(1)
                if not re.match(r"[a-z]+:", target):
                    yield i, target


FILES = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


@pytest.mark.parametrize("path", FILES, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_relative_link_resolves(path):
    bad = []
    for line, target in links(path):
        file, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        if not os.path.exists(dest):
            bad.append(f"line {line}: {target} (no such file)")
        elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
            bad.append(f"line {line}: {target} (no such heading)")
    assert not bad, "\n".join(bad)
