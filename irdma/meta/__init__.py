"""Metadata engines. :func:`open_meta` picks one by URL."""

from __future__ import annotations

import os

from irdma._errors import InvalidArgument

from .base import ROOT_INO, XATTR_CHUNK_SIZE, XATTR_UPDATE, Inode, MetaStore, ShardRecord

#: What every "bad metadata URL" error tells the user to do.
URL_HINT = "pass the URL `irdma up` printed, such as sqlite:///PATH/meta.db"


class InvalidMetaURL(InvalidArgument, ValueError):
    """A metadata URL that names no engine or no database.

    Also a :class:`ValueError`, which is what :func:`open_meta` raised before it had its own error.
    """


def meta_path(url: str) -> str:
    """The absolute database path a metadata URL names (no I/O).

    ``sqlite:///abs/path/meta.db``, ``sqlite://relative/path.db`` or a plain file path.

    Raises:
        InvalidMetaURL: the URL is empty, has another scheme than ``sqlite://``, or names no file.
    """
    if not url.strip():
        raise InvalidMetaURL("the metadata URL is empty", URL_HINT)
    if url.startswith("sqlite://"):
        path = url[len("sqlite://") :]
        if not path:
            raise InvalidMetaURL(f"the metadata URL {url!r} names no database file", URL_HINT)
    elif "://" in url:
        scheme = url.split("://", 1)[0]
        raise InvalidMetaURL(
            f"unsupported metadata URL {url!r}: irdma has no {scheme}:// engine, only sqlite://", URL_HINT
        )
    else:
        path = url
    return os.path.abspath(path)


def open_meta(url: str, *, create: bool = False) -> MetaStore:
    """Open the metadata engine at ``url`` (see :func:`meta_path` for the forms it takes).

    Raises:
        InvalidMetaURL: a malformed URL.
        InvalidArgument: the URL names a directory or a file that is not an irdma
            metadata database.
        NotFound: the database does not exist and ``create`` is False.
        IrdmaError: the database cannot be opened (permissions, locked, I/O error).
    """
    from .sqlite import SqliteMeta

    return SqliteMeta(meta_path(url), create=create)


__all__ = [
    "open_meta", "meta_path", "InvalidMetaURL", "URL_HINT",
    "MetaStore", "Inode", "ShardRecord", "ROOT_INO", "XATTR_UPDATE", "XATTR_CHUNK_SIZE",
]
