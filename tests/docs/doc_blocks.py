"""The pages' fenced code blocks, links and headings, read the way GitHub renders them.

A block is an *example* when the words after its language say so (```` ```bash example ````:
GitHub still highlights it as bash, by the first word of the info string). Every other block
whose language is a shell's (or none) holds commands that a test runs, taking the text from the
page (`tests/docs/test_commands.py` keeps the list).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# the pages whose commands must run in a test or be marked as examples
COMMAND_PAGES = ("README.md", "docs/*.md")
# the pages whose relative links must resolve
LINK_PAGES = ("README.md", "docs/*.md", "bench/README.md", "bench/HISTORY.md")
SHELLS = {"", "bash", "sh", "shell", "console"}

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


@dataclass(frozen=True)
class Block:
    page: str               # the page, relative to the repository root
    line: int               # 1-based line of the opening fence
    info: str               # the info string after the fence
    text: str               # the content, without the fences, de-indented

    @property
    def words(self) -> list[str]:
        return self.info.split()

    @property
    def language(self) -> str:
        return self.words[0].lower() if self.words else ""

    @property
    def is_example(self) -> bool:
        return "example" in self.words[1:]

    @property
    def is_commands(self) -> bool:
        return self.language in SHELLS

    @property
    def first_line(self) -> str:
        return next((ln.strip() for ln in self.text.splitlines() if ln.strip()), "")

    @property
    def first_command(self) -> str:
        """The first command (or, in a block of another language, the first line), without a
        trailing comment."""
        if not self.is_commands:
            return self.first_line
        first = (self.commands() or [self.first_line])[0]
        return re.sub(r"\s+#.*$", "", first)

    @property
    def key(self) -> tuple[str, str]:
        """How tests name a block: its page and its first command."""
        return (self.page, self.first_command)

    def commands(self) -> list[str]:
        """The block's commands: continuation lines joined, blank and comment-only lines left out."""
        out, pending = [], ""
        for raw in self.text.splitlines():
            line = raw.rstrip()
            if line.endswith("\\"):
                pending += line[:-1].rstrip() + " "
                continue
            line = (pending + line.strip()).strip()
            pending = ""
            if line and not line.startswith("#"):
                out.append(line)
        return out

    def where(self) -> str:
        return f"{self.page}:{self.line} ({self.first_line!r})"


def pages(patterns=COMMAND_PAGES) -> list[str]:
    found: list[str] = []
    for pattern in patterns:
        found += sorted(str(p.relative_to(REPO)) for p in REPO.glob(pattern))
    return found


def blocks(page: str) -> list[Block]:
    """The fenced code blocks of `page` (a path relative to the repository root), in order."""
    lines = (REPO / page).read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m or (m.group("fence")[0] == "`" and "`" in m.group("info")):
            i += 1
            continue
        indent, fence, start = len(m.group("indent")), m.group("fence"), i
        body, i = [], i + 1
        while i < len(lines):
            close = _FENCE.match(lines[i])
            if (close and close.group("fence")[0] == fence[0] and len(close.group("fence")) >= len(fence)
                    and not close.group("info").strip()):
                break
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i].lstrip())
            i += 1
        out.append(Block(page, start + 1, m.group("info").strip(), "\n".join(body)))
        i += 1
    return out


def block(page: str, first_command: str) -> Block:
    """The one block of `page` whose first command is `first_command`."""
    found = [b for b in blocks(page) if b.first_command == first_command]
    assert len(found) == 1, f"{page}: {len(found)} blocks start with {first_command!r}"
    return found[0]


def without_code(text: str) -> str:
    """`text` with its fenced blocks and inline code spans blanked out (same line numbers)."""
    lines, inside, fence = text.splitlines(), False, ""
    for n, line in enumerate(lines):
        m = _FENCE.match(line)
        if m and not inside:
            inside, fence = True, m.group("fence")
            lines[n] = ""
        elif m and inside and m.group("fence")[0] == fence[0] and len(m.group("fence")) >= len(fence) \
                and not m.group("info").strip():
            inside = False
            lines[n] = ""
        elif inside:
            lines[n] = ""
        else:
            lines[n] = re.sub(r"(`+)(?:(?!\1).)+?\1", lambda c: " " * len(c.group(0)), line)
    return "\n".join(lines)


_LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\((?P<target><[^>]*>|[^)\s]+)(?:\s+\"[^\"]*\")?\)")


def links(page: str) -> list[tuple[int, str]]:
    """(line, target) of every inline link and image of `page`, outside code."""
    out = []
    for n, line in enumerate(without_code((REPO / page).read_text()).splitlines(), start=1):
        for m in _LINK.finditer(line):
            out.append((n, m.group("target").strip("<>")))
        for m in re.finditer(r"!\[[^\]]*\]\((?P<target>[^)\s]+)\)", line):
            out.append((n, m.group("target")))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped (letters, digits, `_`, `-`
    and spaces kept), spaces to hyphens."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in "-_ ")
    return text.replace(" ", "-")


def anchors(page: str) -> set[str]:
    """The anchors of `page`'s headings, with GitHub's -1, -2, ... for repeated ones."""
    seen: dict[str, int] = {}
    out = set()
    for line in without_code_keep_headings((REPO / page).read_text()):
        m = re.match(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def without_code_keep_headings(text: str) -> list[str]:
    """The lines of `text` outside fenced blocks (inline code kept: headings use it)."""
    out, inside, fence = [], False, ""
    for line in text.splitlines():
        m = _FENCE.match(line)
        if m and not inside:
            inside, fence = True, m.group("fence")
        elif m and inside and m.group("fence")[0] == fence[0] and len(m.group("fence")) >= len(fence) \
                and not m.group("info").strip():
            inside = False
        elif not inside:
            out.append(line)
    return out


def argv(command: str) -> list[str]:
    """A command line split as the shell would, without its trailing comment."""
    return shlex.split(command, comments=True)
