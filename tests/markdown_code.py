"""The code a markdown file shows: its inline `code` spans (with the section each sits in) and the logical lines of
its ```bash blocks, each with the line it starts on. Shared by the tests that check README.md's and the benchmark
notes' commands against the parsers of the programs they run."""
import re


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def prose(text: str) -> str:
    """`text` with its fenced blocks blanked (offsets and line numbers kept): spans and headings outside code."""
    return re.sub(r"^```.*?^```$", lambda m: re.sub(r"[^\n]", " ", m.group(0)), text, flags=re.S | re.M)


def inline_spans(text: str) -> list[tuple[int, str, str]]:
    """(line, section, span) of each inline `code` span; a span broken across lines is joined with a space."""
    outside = prose(text)
    headings = [(m.start(), m.group(1)) for m in re.finditer(r"^## (.+)$", outside, flags=re.M)]
    spans = []
    for m in re.finditer(r"`([^`]+)`", outside):
        section = next((name for start, name in reversed(headings) if start < m.start()), "")
        spans.append((line_of(text, m.start()), section, " ".join(m.group(1).split())))
    return spans


def block_lines(text: str) -> list[tuple[int, str]]:
    """(line of its first physical line, logical line) of each ```bash block line, backslash continuations joined."""
    lines = []
    for block in re.finditer(r"^```(?:bash|sh|shell)\n(.*?)^```$", text, flags=re.S | re.M):
        first = line_of(text, block.start(1))
        pending, start = [], None
        for n, physical in enumerate(block.group(1).splitlines(), first):
            start = n if start is None else start
            if physical.endswith("\\"):
                pending.append(physical[:-1])
                continue
            lines.append((start, " ".join(part.strip() for part in [*pending, physical])))
            pending, start = [], None
    return lines


def command_start_line(text: str, offset: int) -> int:
    """The line a command holding `offset` starts on: back over the lines a backslash continues."""
    lines = text[:offset].split("\n")
    n = len(lines)
    while n > 1 and lines[n - 2].endswith("\\"):
        n -= 1
    return n
