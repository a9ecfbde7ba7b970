"""The code blocks of the README and docs/ that the tests execute.

A block is marked by an HTML comment on the line before its fence, which no renderer shows:

    <!-- test: my_subjects.py -->
    ```python
    ...
    ```

The name says what the block is (a module, a suite, a command or an expected output); the test
that uses it looks it up by that name, so a page cannot change its example without the test
running the new one.
"""
from __future__ import annotations

import re
from pathlib import Path

MARKED = re.compile(r"^<!-- test: (?P<name>[^>]+?) -->\n```(?P<info>[\w-]*)\n(?P<body>.*?)^```$", re.M | re.S)
FENCE = re.compile(r"^```(?P<info>[\w-]*)\n(?P<body>.*?)^```$", re.M | re.S)
# Blocks that are code a reader would copy into a file; commands (sh) and outputs (text) are
# marked only where a test runs or compares them.
CODE_INFOS = {"python", "toml"}


def marked_blocks(path: Path) -> dict[str, str]:
    """name -> body of every marked block of one page (a name used twice is an error)."""
    blocks: dict[str, str] = {}
    for m in MARKED.finditer(path.read_text()):
        assert m["name"] not in blocks, f"{path.name}: two blocks are marked {m['name']!r}"
        blocks[m["name"]] = m["body"]
    return blocks


def doc_block(path: Path, name: str) -> str:
    blocks = marked_blocks(path)
    assert name in blocks, f"{path.name} has no code block marked <!-- test: {name} --> (it has {sorted(blocks)})"
    return blocks[name]


def unmarked_code(path: Path) -> list[str]:
    """The first line of every python or toml block of a page that no test is told about."""
    text = path.read_text()
    marked = {m.start("info") for m in MARKED.finditer(text)}
    return [f"{path.name}: ```{m['info']} {m['body'].splitlines()[0] if m['body'] else ''}"
            for m in FENCE.finditer(text) if m["info"] in CODE_INFOS and m.start("info") not in marked]
