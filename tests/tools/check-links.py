#!/usr/bin/env python3
"""Checks the relative links of the documentation: README.md, the book's chapters
(docs/src/**/*.md) and the chart's README.

A relative link must name a file or directory that exists; with a `#fragment` into a
Markdown file, the fragment must be the id of one of its headings, made the way GitHub and
mdBook make them (the heading's text, lowercased; spaces become '-'; every other character
but letters, digits, '-' and '_' is dropped; a repeated id gets -1, -2, ...), or an explicit
`id="..."` in its HTML. Links to other sites (http:, https:, mailto:) are not checked: there
may be no network. Links inside code (fenced blocks and `code spans`) are not links. A
chapter's link must stay in the book (docs/src): mdBook copies only that, so a link out of
it would break in the built book.

    python3 tests/tools/check-links.py            # the files above
    python3 tests/tools/check-links.py FILE...    # these files only

Exits 1 with a list of the broken links, 0 when there are none. Python 3.11, stdlib only.
"""

import re
import sys
import urllib.parse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BOOK = ROOT / "docs/src"

# Fences may be indented (inside a list item).
FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
ATX_HEADING = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
SETEXT_UNDERLINE = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
CODE_SPAN = re.compile(r"(`+)(.+?)(?<!`)\1(?!`)")
# [text](target) and ![alt](target), with an optional "title"; <target> for targets with spaces.
INLINE_LINK = re.compile(r"!?\[(?P<text>(?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*(?:<(?P<angle>[^>]*)>|(?P<bare>[^)\s]*))(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
# [label]: target
REFERENCE_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(?P<target>[^>\s]+)>?")
HTML_ID = re.compile(r"""\b(?:id|name)\s*=\s*["']([^"']+)["']""")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def default_files():
    files = [ROOT / "README.md", ROOT / "charts/nightshift/README.md"]
    files += sorted((ROOT / "docs/src").rglob("*.md"))
    return [file for file in files if file.exists()]


def prose_lines(text):
    """(line number, line) of every line outside fenced code blocks."""
    fence = None
    for number, line in enumerate(text.splitlines(), start=1):
        opening = FENCE.match(line)
        if fence is None:
            if opening:
                fence = opening.group(1)
                continue
            yield number, line
        elif set(line.strip()) == {fence[0]} and len(line.strip()) >= len(fence):
            fence = None


def heading_text(raw):
    """A heading's text as rendered: code spans keep their content, links their text,
    images their alt text, and HTML tags go."""
    text = CODE_SPAN.sub(lambda match: match.group(2).strip(), raw)
    text = INLINE_LINK.sub(lambda match: match.group("text"), text)
    text = re.sub(r"<[^>]+>", "", text)
    text = re.sub(r"\\(.)", r"\1", text)
    return text


def slug(text):
    out = []
    for char in heading_text(text).strip().lower():
        if char.isalnum() or char in "-_":
            out.append(char)
        elif char.isspace():
            out.append("-")
    return "".join(out)


def anchors(path, cache={}):
    """Every fragment a link may name in the Markdown file at path."""
    if path not in cache:
        found = set()
        seen = {}
        previous = ""
        for _, line in prose_lines(path.read_text(encoding="utf-8")):
            heading = None
            atx = ATX_HEADING.match(line)
            if atx:
                heading = atx.group(2) or ""
            elif SETEXT_UNDERLINE.match(line) and previous.strip() and "|" not in previous and not ATX_HEADING.match(previous):
                heading = previous.strip()
            if heading is not None:
                base = slug(heading)
                count = seen.get(base, 0)
                seen[base] = count + 1
                found.add(base if count == 0 else f"{base}-{count}")
            found.update(HTML_ID.findall(line))
            previous = line
        cache[path] = found
    return cache[path]


def links(path):
    """(line number, target) of every link in the Markdown file at path."""
    for number, line in prose_lines(path.read_text(encoding="utf-8")):
        # A code span is not a link, but a link's text may hold one: keep its place.
        line = CODE_SPAN.sub(lambda match: "x" * len(match.group(0)), line)
        definition = REFERENCE_DEFINITION.match(line)
        if definition:
            yield number, definition.group("target")
            continue
        for match in INLINE_LINK.finditer(line):
            target = match.group("angle") if match.group("angle") is not None else match.group("bare")
            yield number, target


def check(path):
    """The broken links of one file, as messages."""
    broken = []
    for number, target in links(path):
        where = f"{path.relative_to(ROOT)}:{number}: ({target})"
        if not target:
            broken.append(f"{where}: empty link")
            continue
        if SCHEME.match(target) or target.startswith("//"):
            continue  # another site (or mailto:): not checked
        file_part, _, fragment = target.partition("#")
        file_part = urllib.parse.unquote(file_part.split("?")[0])
        fragment = urllib.parse.unquote(fragment)
        if file_part.startswith("/"):
            broken.append(f"{where}: an absolute path; link relative to this file")
            continue
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{where}: no such file or directory: {linked.relative_to(ROOT) if linked.is_relative_to(ROOT) else linked}")
            continue
        if not linked.is_relative_to(ROOT):
            broken.append(f"{where}: outside the repository")
            continue
        if path.is_relative_to(BOOK) and not linked.is_relative_to(BOOK):
            broken.append(f"{where}: leaves the book (docs/src), so it breaks in the built book; name the file as `code` instead")
            continue
        if fragment and linked.is_file() and linked.suffix == ".md":
            if fragment not in anchors(linked):
                words = set(fragment.split("-"))
                near = sorted((a for a in anchors(linked) if words & set(a.split("-"))), key=lambda a: -len(words & set(a.split("-"))))
                hint = f" (did you mean #{', #'.join(near[:3])}?)" if near else ""
                broken.append(f"{where}: no heading #{fragment} in {linked.relative_to(ROOT)}{hint}")
    return broken


def main(args):
    files = [Path(arg).resolve() for arg in args] or default_files()
    broken = []
    count = 0
    for path in files:
        count += sum(1 for _ in links(path))
        broken += check(path)
    if broken:
        print(f"check-links: {len(broken)} broken link(s):", file=sys.stderr)
        for message in broken:
            print(f"  {message}", file=sys.stderr)
        return 1
    print(f"check-links: {count} links in {len(files)} files, every relative one resolves (other sites not checked)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
