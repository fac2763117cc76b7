"""A generated block of a markdown guide: the text between two HTML-comment markers, which a
generator script renders and this module prints, checks (``--check``: exit 1 with a diff when
the guide's block is stale) or rewrites (``--write``). Used by ``config_tables.py`` and
``module_graph.py``."""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Block:
    begin: str
    end: str
    what: str
    """Its name in messages, e.g. ``config tables``."""

    def read(self, text: str) -> str:
        """The document's current block (between the markers, markers excluded)."""
        start, end = text.find(self.begin), text.find(self.end)
        if start < 0 or end < start:
            raise ValueError(f"the document has no {self.begin} ... {self.end} block")
        return text[start + len(self.begin) :].split(self.end, 1)[0].removeprefix("\n")

    def replace(self, text: str, block: str) -> str:
        """``text`` with the block between the markers replaced by ``block``."""
        self.read(text)  # raises without markers
        head, rest = text.split(self.begin, 1)
        tail = rest.split(self.end, 1)[1]
        return f"{head}{self.begin}\n{block}{self.end}{tail}"

    def main(
        self,
        argv: Sequence[str] | None,
        render: Callable[[], str],
        default_doc: Path,
        description: str,
        doc_flags: Sequence[str] = ("--doc",),
    ) -> int:
        """Print the block, check the guide's against it or rewrite it."""
        parser = argparse.ArgumentParser(description=description)
        mode = parser.add_mutually_exclusive_group()
        mode.add_argument("--check", action="store_true", help="exit 1 if the block is stale")
        mode.add_argument("--write", action="store_true", help="rewrite the block in place")
        parser.add_argument(*doc_flags, dest="doc", type=Path, default=default_doc)
        args = parser.parse_args(argv)
        block = render()
        if not (args.check or args.write):
            sys.stdout.write(block)
            return 0
        text = args.doc.read_text(encoding="utf-8")
        current = self.read(text)
        if args.write:
            if current != block:
                args.doc.write_text(self.replace(text, block), encoding="utf-8")
                print(f"{args.doc}: {self.what} rewritten")
            return 0
        if current == block:
            return 0
        sys.stdout.writelines(
            difflib.unified_diff(
                current.splitlines(keepends=True),
                block.splitlines(keepends=True),
                f"{args.doc} ({self.what})",
                "generated (--write rewrites it)",
            )
        )
        return 1
