"""How every command ends: a user error is one line on stderr and exit status 2; a bug keeps its traceback.

    def run(argv=None) -> int:          # in train.py, evaluate.py, generate.py, ablate.py
        return cli.run(main, argv)

    if __name__ == "__main__":
        sys.exit(run())

`main(argv)` raises as a library does (tests call it); `run` is the command line. User errors are
what the user can fix: ValueError and its subclasses (`DataError`, `OptionError`, `ConfigError`,
`UsageError`), `CheckpointError`, and the OSErrors of files and folders (missing, already there,
not writable, a folder where a file should be, disk full, read-only file system, a name too long);
the line names the file. ``--debug`` (on any command, before a ``--``) or ``SCRATCHFORMER_DEBUG=1``
lets the error through with its full traceback. Ctrl-C prints ``interrupted`` and exits with 130; a
closed stdout (``generate ... | head``) ends the command quietly with 141.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from collections.abc import Callable

from .checkpoint import CheckpointError

EXIT_USER_ERROR = 2  # argparse's status for a bad command line
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports Ctrl-C
DEBUG_ENV = "SCRATCHFORMER_DEBUG"

_FILE_ERRORS = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)
# disk full, quota, read-only file system; a path too long or looping through its links
_USER_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.ENAMETOOLONG, errno.ELOOP}
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, as a shell reports `... | head`


class UsageError(ValueError):
    """A flag, or a combination of flags, a command cannot take; the message names the flag."""


def is_user_error(e: BaseException) -> bool:
    """Whether `e` is the user's to fix (reported as one line) rather than a bug (a traceback)."""
    if isinstance(e, (ValueError, CheckpointError, *_FILE_ERRORS)):
        return True
    return isinstance(e, OSError) and e.errno in _USER_ERRNOS


def describe(e: BaseException) -> str:
    """The one line of a user error: its message; an OSError from the system as ``FILE: reason``."""
    if isinstance(e, OSError) and e.strerror:
        names = " -> ".join(str(n) for n in (e.filename, e.filename2) if n is not None)
        return f"{names}: {e.strerror}" if names else e.strerror
    return str(e) or type(e).__name__


def debug_requested(argv: list[str]) -> tuple[list[str], bool]:
    """(argv without ``--debug``, whether it or SCRATCHFORMER_DEBUG asked for tracebacks). Only
    flags before a ``--`` count: what follows belongs to another command (ablate's train flags)."""
    end = argv.index("--") if "--" in argv else len(argv)
    head = [a for a in argv[:end] if a != "--debug"]
    flag = len(head) < end
    env = os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")
    return head + argv[end:], flag or env


def given_flags(args: argparse.Namespace, parser: argparse.ArgumentParser, flags) -> list[str]:
    """Those of `flags` ("--beam-size", ...) whose value in `args` is not the parser's default."""
    dests = {f: f[2:].replace("-", "_") for f in flags}
    return [f for f, dest in dests.items() if getattr(args, dest) != parser.get_default(dest)]


def shown(v) -> str:
    """An option's value as a message shows it: a list as its flag's words, None as "unset"."""
    return "unset" if v is None else " ".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)


def add_debug_flag(parser: argparse.ArgumentParser) -> None:
    """Declare ``--debug`` so that ``--help`` lists it (`run` takes it off before parsing)."""
    parser.add_argument("--debug", action="store_true",
                        help=f"show the full traceback of an error (also: {DEBUG_ENV}=1)")


def run(main: Callable, argv: list[str] | None = None) -> int:
    """Call ``main(argv)`` as a command: returns 0, EXIT_USER_ERROR after printing ``error: <one
    line>`` to stderr for a user error, EXIT_INTERRUPTED on Ctrl-C. Anything else (a bug), and
    every error with ``--debug``, propagates with its traceback."""
    argv, debug = debug_requested(list(sys.argv[1:] if argv is None else argv))
    try:
        main(argv)
    except KeyboardInterrupt:
        if debug:
            raise
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader of stdout is gone (`generate ... | head`): end quietly, as `yes | head`
        if debug:
            raise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the flush at exit would raise again
        return EXIT_BROKEN_PIPE
    except Exception as e:
        if debug or not is_user_error(e):
            raise
        print(f"error: {describe(e)}", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0
