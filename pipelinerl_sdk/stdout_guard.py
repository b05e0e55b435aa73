"""Keep a command's stdout for its one result: everything else written there goes to stderr.

``--json`` commands promise one JSON object on stdout, but engines and libraries print there
(DeepSpeed's "Setting accelerator to CPU", torch's warnings from native code, child processes that
inherit the descriptor). :func:`stdout_to_stderr` points file descriptor 1 (and ``sys.stdout``) at
stderr for the duration of the work, so a ``print`` of the result afterwards is the only thing on
stdout.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Within the block, writes to fd 1 (Python's, native code's, children's) land on stderr;
    on exit fd 1 and ``sys.stdout`` are restored. Not reentrant across threads: use it around a
    command's whole work, in the main thread."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        previous = sys.stdout
        sys.stdout = sys.stderr
        try:
            yield
        finally:
            sys.stdout = previous
            sys.stderr.flush()
            os.dup2(saved, 1)
    finally:
        os.close(saved)
