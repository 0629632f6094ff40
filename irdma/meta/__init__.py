"""Metadata engines. :func:`open_meta` picks one by URL."""

from __future__ import annotations

import os

from .base import ROOT_INO, XATTR_CHUNK_SIZE, XATTR_UPDATE, Inode, MetaStore, ShardRecord


def open_meta(url: str, *, create: bool = False) -> MetaStore:
    """Open the metadata engine at ``url``.

    ``sqlite:///abs/path/meta.db``, ``sqlite://relative/path.db`` or a plain file path.

    Raises:
        NotFound: the database does not exist and ``create`` is False.
        ValueError: an unknown URL scheme.
    """
    from .sqlite import SqliteMeta

    if url.startswith("sqlite://"):
        path = url[len("sqlite://") :]
    elif "://" in url:
        raise ValueError(f"unknown metadata URL {url!r}: use sqlite:///PATH/meta.db")
    else:
        path = url
    return SqliteMeta(os.path.abspath(path), create=create)


__all__ = ["open_meta", "MetaStore", "Inode", "ShardRecord", "ROOT_INO", "XATTR_UPDATE", "XATTR_CHUNK_SIZE"]
