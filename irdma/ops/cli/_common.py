"""What every ``irdma`` command shares: the consoles (messages on standard error, results on
standard output), the ``--meta``/``--dir``/``--metrics``/``--key-file`` options, sizes, and
the one-line errors (:func:`friendly`, :func:`fail`, :class:`IrdmaCLI`)."""

from __future__ import annotations

import errno
import functools
import logging
import os
import sqlite3
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import click
from rich.console import Console
from rich.markup import escape

from ..._errors import IrdmaError
from ...units import parse_size
from .. import cluster as _cluster


class _Messages(Console):
    """The console of messages (standard error): at a terminal a line wraps at its width; elsewhere
    (a pipe, a file, a script's capture) each message stays one line, whole, however long, for
    grep and for copying the paths and commands it names. Tables fit the width either way."""

    def __init__(self) -> None:
        super().__init__(stderr=True)
        self.soft_wrap = not self.is_terminal

    def print(self, *objects: Any, **kwargs: Any) -> None:
        if self.is_terminal:
            kwargs.pop("soft_wrap", None)  # wrap at the terminal's width, whatever the caller asked
        super().print(*objects, **kwargs)


console = _Messages()
# results on standard output: one line each, however long (URLs, JSON); tables fit the terminal
out = Console(soft_wrap=True)


def _meta_default() -> str:
    return os.environ.get("IRDMA_META") or _cluster.meta_url_of(_cluster.default_dir())


def _meta_explicit() -> bool:
    """Whether ``--meta`` was given on the command line. Only it names the namespace against a
    path under a mount; ``$IRDMA_META``, a standing default as the default cluster is, yields to
    the mount's namespace."""
    from click.core import ParameterSource

    ctx = click.get_current_context(silent=True)
    return ctx is not None and ctx.get_parameter_source("meta_url") is ParameterSource.COMMANDLINE


def target(path: str, meta_url: str) -> Any:
    """The namespace and path that PATH names (:func:`irdma.ops.mountpath.resolve_target`): a path
    under an irdma mount names that mount's namespace and the directory it shows, whatever
    ``$IRDMA_META`` or the default cluster is (logged at info when ``$IRDMA_META`` names another).

    Raises:
        InvalidArgument: PATH is under a mount of another namespace than the one --meta names.
        IrdmaError: which directory the mount shows is unknown.
    """
    from .. import info as I

    explicit = _meta_explicit()
    where = I.resolve_target(path, meta_url, explicit)
    env = os.environ.get("IRDMA_META")
    if where.mount is not None and not explicit and env and I.namespace_key(env) != I.namespace_key(where.meta_url):
        logging.getLogger("irdma.ops").info("%s is under the mount on %s: its namespace %s, not $IRDMA_META's", path,
                                            where.mount, where.meta_url)
    return where


META_OPTION = click.option(
    "--meta", "meta_url", default=_meta_default, show_default="$IRDMA_META or the default cluster's",
    help="Metadata URL of the namespace (sqlite:///PATH/meta.db or postgresql://USER@HOST:PORT/DB).",
)
DIR_OPTION = click.option(
    "--dir", "cluster_dir", default=_cluster.default_dir, show_default="$IRDMA_HOME or ~/.irdma",
    type=click.Path(file_okay=False), help="Directory of the local cluster.",
)


METRICS_OPTION = click.option(
    "--metrics", "metrics_addr", default=None, metavar="HOST:PORT",
    help="Serve Prometheus metrics at http://HOST:PORT/metrics (port 0: a free one); `irdma stats` shows them.",
)


def _size(ctx: Any, param: Any, value: str) -> int:
    try:
        return parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _leaf(exc: BaseException) -> BaseException:
    """The one exception inside nested exception groups (trio's nurseries wrap), else ``exc``."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


#: What to do next after an OSError, by errno (the default: check the path named).
_OS_HINTS = {
    errno.EACCES: "check the permissions of that path",
    errno.EPERM: "check the permissions of that path",
    errno.ENOENT: "check that the path exists",
    errno.ENOTDIR: "check the path: a part of it is not a directory",
    errno.EROFS: "pick a path on a writable filesystem",
    errno.ENOSPC: "free some disk space",
    errno.EADDRINUSE: "pick another port, or stop the process that listens there",
    errno.EADDRNOTAVAIL: "pick an address of this machine",
    errno.ECONNREFUSED: "check that the server runs at that address",
    errno.ENOMEM: "ask for less memory",
}


def _error_line(exc: BaseException, verbose: int) -> tuple[str, int]:
    """The one-line message for an error that ends a command, and the exit code.

    Errors of the user's making (:class:`IrdmaError`, a system call that failed, the metadata
    database) say what happened and what to do; anything else is a bug in irdma.
    """
    if isinstance(exc, IrdmaError):
        return str(exc), 1
    if isinstance(exc, OSError):
        what = exc.strerror or str(exc)
        where = " ".join(f"{f}" for f in (exc.filename, exc.filename2) if f is not None)
        hint = _OS_HINTS.get(exc.errno or 0, "check the path or address it names, then retry")
        return f"{what}{': ' + where if where else ''} ({hint})", 1
    if isinstance(exc, sqlite3.Error):
        return (f"metadata database: {exc} (check that --meta names the database `irdma up` made;"
                " rerun with -v for details)"), 1
    rerun = "see the traceback above" if verbose else "rerun with -v for the traceback"
    return f"unexpected {type(exc).__name__}: {exc} (a bug in irdma: {rerun} and report it)", 1


def _verbosity() -> int:
    ctx = click.get_current_context(silent=True)
    return int(ctx.find_root().params.get("verbose") or 0) if ctx is not None else 0


def fail(message: str, code: int = 1) -> NoReturn:
    """Print ``error: MESSAGE`` on stderr as one line (never wrapped) and exit with ``code``."""
    console.print(f"[bold red]error:[/] {escape(message)}", markup=True, highlight=False, soft_wrap=True)
    sys.exit(code)


def friendly(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn every error that ends a command into one line with what to do next, and exit 1.

    Click's own usage errors pass through (:class:`IrdmaCLI` prints them, exit 2). A bug shows
    its traceback only with ``-v``.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except Exception as exc:
            leaf = _leaf(exc)
            if isinstance(leaf, click.ClickException | click.exceptions.Exit | click.Abort):
                raise leaf from None
            verbose = _verbosity()
            if verbose and not isinstance(leaf, IrdmaError | OSError | sqlite3.Error):
                console.print_exception()
            fail(*_error_line(leaf, verbose))
        except KeyboardInterrupt:
            fail("interrupted", 130)

    return wrapper


#: Click (8.2 and later) raises this for a group called without a command: it shows the help.
_NO_ARGS_IS_HELP: Any = getattr(click.exceptions, "NoArgsIsHelpError", ())


class IrdmaCLI(click.Group):
    """The ``irdma`` group: usage errors, too, are one line (``error: ... (see --help)``), exit 2.

    ``lazy``: commands made on first use (name -> a function that returns the command), so
    that `irdma` imports only what the command it runs needs: ``irdma mount``'s options are
    :mod:`irdma.fs`'s, and the FUSE filesystem need not load for ``irdma server``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy: dict[str, Callable[[], click.Command]] = {}

    def load(self, name: str) -> click.Command | None:
        """The command ``name``, made now if it is a lazy one; None if there is none."""
        make = self.lazy.get(name)
        if make is not None:
            self.add_command(make(), name)  # a failed make leaves it lazy: the next use tries again
            del self.lazy[name]
        return self.commands.get(name)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        self.load(cmd_name)
        return super().get_command(ctx, cmd_name)

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except _NO_ARGS_IS_HELP as exc:
            exc.show()  # `irdma shard` alone: the help, as click prints it
            sys.exit(exc.exit_code)
        except click.UsageError as exc:
            ctx = exc.ctx
            where = f"`{ctx.command_path} --help`" if ctx is not None else "`irdma --help`"
            fail(f"{exc.format_message()} (see {where})", exc.exit_code)
        except click.ClickException as exc:
            fail(exc.format_message(), exc.exit_code)
        except click.Abort:
            fail("aborted", 1)
        sys.exit(rv if isinstance(rv, int) else 0)


def times_in_files(held: int, in_files: int) -> str:
    """How many times the bytes in files the bytes held on the shards are (replicas, whole
    chunks, snapshots' copies), as ``2.0x`` or ``2,048x``; "" when no file holds a byte."""
    if not in_files:
        return ""
    r = held / in_files
    return f"{r:.1f}x" if r < 100 else f"{r:,.0f}x"


def _redact(url: str) -> str:
    """``url`` with any password in it shown as ``***``."""
    from ...meta import redact

    return redact(url)


def _key_ring(meta_url: str | None) -> Any:
    from ...meta import default_key_file
    from ...wire.auth import KeySource

    return KeySource(default_key_file(meta_url)).ring()


def _set_key_file(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    from ...wire.auth import KEY_FILE_ENV

    if value:
        os.environ[KEY_FILE_ENV] = os.path.abspath(value)  # what every client and `irdma up` read


def _add_key_file_options(group: click.Group) -> None:
    """Give every command ``--key-file`` (the server has its own)."""
    for name, cmd in group.commands.items():
        _add_key_file_option(name, cmd)


def _add_key_file_option(name: str, cmd: click.Command) -> None:
    """Give command ``cmd`` (every one of a group) ``--key-file``, unless it is the server or has one."""
    if isinstance(cmd, click.Group):
        _add_key_file_options(cmd)
    elif name != "server" and not any(p.name == "key_file" for p in cmd.params):
        cmd.params.append(click.Option(
            ["--key-file"], type=click.Path(dir_okay=False), expose_value=False, is_eager=True,
            callback=_set_key_file, help="The cluster's key file [default: $IRDMA_KEY_FILE, else cluster.key"
            " beside the metadata]."))
