"""Print pydoc's plain-text pages of the modules named on the command line, NUL-separated.

Run by ``calibration.stdlib_docs`` as ``python -I -c SOURCE PARENT_PID MODULE...`` (this
file's text) in a fresh, isolated interpreter: a page renders the live objects of its
module, so in the caller's process it shows whatever that process imported or patched
(transformers adds methods to ``logging.Logger``, another library wraps
``inspect.getfile``, handlers pile up in ``logging.shutdown``'s default), and the
calibration text, so the quantisation, would depend on what ran before. Standard library only, on purpose: importing tokenmill here would
bring those patches back. It ends with its parent: each page is written as soon as it is
rendered (a closed pipe ends it) and the parent's pid is checked between pages.
"""

import importlib
import os
import pydoc
import sys

SEPARATOR = "\0"


def main(parent_pid: int, names: list[str]) -> None:
    for name in names:
        if os.getppid() != parent_pid:
            sys.exit(1)
        try:
            page = pydoc.render_doc(importlib.import_module(name), renderer=pydoc.plaintext)
        except ImportError:  # a build without the module (sqlite3, say)
            continue
        sys.stdout.write(page.replace(SEPARATOR, "") + SEPARATOR)
        sys.stdout.flush()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])
