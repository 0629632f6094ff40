"""Metadata engines. :func:`open_meta` picks one by URL."""

from __future__ import annotations

import os

from irdma._errors import InvalidArgument
from irdma.wire import auth

from .base import ROOT_INO, XATTR_CHUNK_SIZE, XATTR_UPDATE, Inode, MetaStore, ShardRecord
from .sql_rows import redact

#: What every "bad metadata URL" error tells the user to do.
URL_HINT = ("pass the URL `irdma up` printed, such as sqlite:///PATH/meta.db, or a PostgreSQL database's,"
            " such as postgresql://USER@HOST:5432/DB")
#: The schemes of PostgreSQL URLs.
POSTGRES_SCHEMES = ("postgresql", "postgres")


class InvalidMetaURL(InvalidArgument, ValueError):
    """A metadata URL that names no engine or no database.

    Also a :class:`ValueError`, which is what :func:`open_meta` raised before it had its own error.
    """


def meta_scheme(url: str) -> str:
    """The engine a metadata URL names (no I/O): ``sqlite`` (also for a plain file path) or
    ``postgresql`` (``postgresql://`` and ``postgres://`` URLs).

    Raises:
        InvalidMetaURL: the URL is empty or has another scheme.
    """
    if not url.strip():
        raise InvalidMetaURL("the metadata URL is empty", URL_HINT)
    if "://" not in url or url.startswith("sqlite://"):
        return "sqlite"
    scheme = url.split("://", 1)[0]
    if scheme in POSTGRES_SCHEMES:
        return "postgresql"
    raise InvalidMetaURL(
        f"unsupported metadata URL {url!r}: irdma has no {scheme}:// engine, only sqlite:// and postgresql://",
        URL_HINT)


def meta_path(url: str) -> str:
    """The absolute database path a metadata URL names (no I/O).

    ``sqlite:///abs/path/meta.db``, ``sqlite://relative/path.db`` or a plain file path.

    Raises:
        InvalidMetaURL: the URL is empty, has another scheme than ``sqlite://`` (a PostgreSQL
            database is no file: :func:`meta_scheme` tells them apart), or names no file.
    """
    if not url.strip():
        raise InvalidMetaURL("the metadata URL is empty", URL_HINT)
    if url.startswith("sqlite://"):
        path = url[len("sqlite://") :]
        if not path:
            raise InvalidMetaURL(f"the metadata URL {url!r} names no database file", URL_HINT)
    elif "://" in url:
        if meta_scheme(url) == "postgresql":
            raise InvalidMetaURL(f"{redact(url)} names a PostgreSQL database, not a file",
                                 "pass the cluster key file explicitly (--key-file)")
    else:
        path = url
    return os.path.abspath(path)


def open_meta(url: str, *, create: bool = False) -> MetaStore:
    """Open the metadata engine at ``url``: an SQLite file (see :func:`meta_path` for the forms)
    or a PostgreSQL database (``postgresql://user:password@host:port/db``, ``postgres://``;
    several hosts in libpq's form ``postgresql://h1:5432,h2:5432/db?target_session_attrs=read-write``;
    ``?failover_timeout=SECONDS``: how long calls wait for a lost server; see
    :class:`~irdma.meta.postgres.PostgresMeta`).

    Args:
        url: the metadata URL.
        create: make the namespace (schema and root directory) where there is none.

    Raises:
        InvalidMetaURL: a malformed URL.
        InvalidArgument: the URL names a directory or a file that is not an irdma
            metadata database, or a PostgreSQL database without the irdma tables (and
            ``create`` is False: `irdma format` makes them), or a bad ``failover_timeout``.
        NotFound: the database does not exist and ``create`` is False.
        IrdmaError: the database cannot be opened (permissions, locked, I/O error), or the
            PostgreSQL server cannot be reached within its connect timeout.
    """
    if meta_scheme(url) == "postgresql":
        from .postgres import PostgresMeta

        return PostgresMeta(url, create=create)
    from .sqlite import SqliteMeta

    return SqliteMeta(meta_path(url), create=create)


def default_key_file(meta_url: str | None) -> str | None:
    """The key file of the cluster ``meta_url`` names (:mod:`irdma.wire.auth`): ``$IRDMA_KEY_FILE``,
    else ``cluster.key`` beside a SQLite namespace when it exists, else None (no I/O beyond a
    stat: the file is read by :class:`irdma.wire.auth.KeySource`)."""
    env = os.environ.get(auth.KEY_FILE_ENV)
    if env:
        return env
    if meta_url:
        try:
            path = meta_path(meta_url)
        except InvalidMetaURL:
            return None
        candidate = os.path.join(os.path.dirname(os.path.abspath(path)), auth.KEY_FILE_NAME)
        if os.path.exists(candidate):
            return candidate
    return None


__all__ = [
    "default_key_file",
    "open_meta", "meta_path", "meta_scheme", "redact", "InvalidMetaURL", "URL_HINT",
    "MetaStore", "Inode", "ShardRecord", "ROOT_INO", "XATTR_UPDATE", "XATTR_CHUNK_SIZE",
]
