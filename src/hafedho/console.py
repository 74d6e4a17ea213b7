"""The ``hafedho`` command's entry point.

Loading the libraries (torch) takes a second or more: a Ctrl-C then ends in one line, as one during a run does
(``cli.main``), never a traceback through torch's imports. Standard library only, so nothing here is slow.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    try:
        from hafedho.cli import main as cli_main

        return cli_main(argv)  # a Ctrl-C once the command runs gets the command's own line there
    except KeyboardInterrupt:  # while importing or reading the arguments
        print("hafedho: interrupted while starting; nothing was run or written", file=sys.stderr)
        return 130
