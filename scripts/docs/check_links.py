"""Check the relative links of the README and docs/: each file exists, and each #anchor is a heading.

    .venv/bin/python scripts/docs/check_links.py [files...]   (default: README.md docs/*.md scripts/**/README.md)

Anchors follow GitHub's rule: the heading in lower case, punctuation other than '-' and '_'
dropped, spaces turned into '-', '-1', '-2', ... added to repeats. External links (http, mailto)
are not followed. Exits 1 and names each broken link.
"""
from __future__ import annotations

import glob
import os
import re
import sys

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")


def slug(heading: str) -> str:
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def lines_outside_code(path: str) -> list[str]:
    out, in_code = [], False
    with open(path, encoding="utf-8") as f:
        for line in f:
            if FENCE.match(line):
                in_code = not in_code
                continue
            out.append("" if in_code else line)
    return out


def anchors(path: str) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    for line in lines_outside_code(path):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        result.add(base if n == 0 else f"{base}-{n}")
    return result


def check(path: str) -> list[str]:
    errors = []
    for lineno, line in enumerate(lines_outside_code(path), 1):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"^[a-z]+:", target):
                continue
            file_part, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
            if not os.path.exists(dest):
                errors.append(f"{path}:{lineno}: {target}: no such file {dest}")
            elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
                errors.append(f"{path}:{lineno}: {target}: no heading #{anchor} in {dest}")
    return errors


def main(argv: list[str]) -> int:
    files = argv or ["README.md", *sorted(glob.glob("docs/*.md")), *sorted(glob.glob("scripts/**/README.md", recursive=True))]
    errors = [e for f in files for e in check(f)]
    print("\n".join(errors) if errors else f"{len(files)} files: every relative link resolves")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
