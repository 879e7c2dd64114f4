"""README.md's commands as a reader copies them: the fenced ```bash blocks of a section, split into commands
the way a shell reads them.  The tests that run README's lines as printed take them from here, so a README edit
that breaks a command breaks a test."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def section(heading: str, text: str | None = None) -> str:
    """The text under the Markdown heading `heading` (any level, without its #s) up to the next heading of the
    same or a higher level."""
    text = README.read_text() if text is None else text
    lines = text.splitlines()
    headings = []  # (line index, level, title); a `# comment` inside a fenced block is no heading
    fenced = False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"(#+)\s+(.*?)\s*$", line)):
            headings.append((i, len(m.group(1)), m.group(2)))
    for k, (i, level, title) in enumerate(headings):
        if title == heading:
            end = next((j for j, lv, _ in headings[k + 1:] if lv <= level), len(lines))
            return "\n".join(lines[i + 1:end])
    raise LookupError(f"README has no heading {heading!r}")


def bash_blocks(heading: str, text: str | None = None) -> list[str]:
    """The ```bash fenced blocks under `heading`, in order."""
    return re.findall(r"^```bash\n(.*?)^```", section(heading, text), flags=re.S | re.M)


def commands(block: str) -> list[list[str]]:
    """The block's commands, each as the argv a POSIX shell would build: comments dropped, a quoted string that
    runs over several lines kept as one argument, a trailing backslash joining lines."""
    out: list[list[str]] = []
    pending = ""
    for line in block.splitlines():
        pending = f"{pending}\n{line}" if pending else line
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        try:
            argv = shlex.split(pending, comments=True)
        except ValueError:  # an open quote: the command goes on on the next line
            continue
        pending = ""
        if argv:
            out.append(argv)
    if pending.strip():
        raise ValueError(f"unterminated command in README block: {pending!r}")
    return out
