"""Which namespace and which directory a path names (``irdma info`` and ``irdma snapshot``).

A path under an irdma mount (the kernel's mount table, ``/proc/self/mountinfo``) names that
mount's namespace (its source, ``irdma:URL``) and the directory the mount shows: the mount's
root answers the xattr :data:`MOUNT_XATTR` (its source and ``--subdir``), and the record the
mount keeps while it runs (:func:`irdma._proc.read_mount_record`) is the fallback. Any other
path is a path of the namespace ``--meta`` or ``$IRDMA_META`` names. A ``--meta`` given on the
command line that names another namespace than the mount's is an error (:func:`resolve_target`);
two URLs of one namespace (another spelling of a PostgreSQL host, a path through a bind mount)
compare equal (:func:`namespace_key`, :func:`same_namespace`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from .._errors import InvalidArgument, IrdmaError


@dataclass(frozen=True)
class IrdmaMount:
    """One irdma mount in the mount table.

    Attributes:
        mountpoint: as the table writes it (absolute, resolved).
        source: ``irdma:META_URL`` (:func:`irdma.fs.mount.mount_source`: a PostgreSQL URL
            without its password, an SQLite path made absolute).
    """

    mountpoint: str
    source: str

    @property
    def meta_url(self) -> str | None:
        """The metadata URL of the mount's namespace, or None when the source names none."""
        url = self.source[len("irdma:"):] if self.source.startswith("irdma:") else ""
        return url or None


def mount_table(mountinfo: str = "/proc/self/mountinfo") -> list[IrdmaMount]:
    """The irdma mounts (type ``fuse.irdma``) in the mount table, in its order (a mount stacked
    on another comes after it).

    Reads only the table: no request goes to a filesystem. An unreadable table gives none.
    """
    import re

    def unescape(text: str) -> str:
        return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), text)

    out = []
    try:
        with open(mountinfo) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    for line in lines:
        fields = line.split()
        if len(fields) < 7 or "-" not in fields[6:]:
            continue
        sep = fields.index("-", 6)
        if len(fields) > sep + 1 and fields[sep + 1] == "fuse.irdma":
            source = unescape(fields[sep + 2]) if len(fields) > sep + 2 else ""
            out.append(IrdmaMount(unescape(fields[4]), source))
    return out


def irdma_mounts(mountinfo: str = "/proc/self/mountinfo") -> list[str]:
    """The mountpoints of irdma mounts (type ``fuse.irdma``) in the mount table, as it writes them.

    Reads only the table: no request goes to a filesystem. An unreadable table gives none.
    """
    return [m.mountpoint for m in mount_table(mountinfo)]


def namespace_path(path: str, mounts: list[str] | None = None) -> tuple[str, str | None]:
    """The path ``path`` names below the irdma mount it lies under, and that mount (None if none).

    A path under an irdma mountpoint (``/mnt/ps/w/kernel``, or a relative one from the current
    directory) names the path below the mountpoint (``/w/kernel``): a path in the directory the
    mount shows (:func:`resolve_target` adds a ``--subdir`` mount's directory). Any other path
    is a path in the namespace already (``w`` and ``/w`` alike). Symbolic links are followed
    only when the path as written is under no mount.

    Args:
        mounts: the irdma mountpoints (default: :func:`irdma_mounts`).
    """
    mounts = irdma_mounts() if mounts is None else mounts
    plain = os.path.normpath(os.path.abspath(path))
    candidates = [plain]
    if os.path.lexists(plain):
        real = os.path.realpath(plain)
        if real != plain:
            candidates.append(real)
    for cand in candidates:
        best = max((m for m in mounts if cand == m or cand.startswith(m.rstrip("/") + "/")), key=len, default=None)
        if best is not None:
            rest = cand[len(best.rstrip("/")):]
            return "/" + rest.strip("/"), best
    return os.path.normpath("/" + path.strip("/")) if path.strip("/") else "/", None


#: Hosts that name this machine's loopback alike in a PostgreSQL URL (no name is resolved).
_LOOPBACK = ("localhost", "127.0.0.1", "::1")
#: PostgreSQL's port where a URL names none.
_PG_PORT = "5432"


def _pg_host(host: str) -> str:
    """``HOST:PORT`` of one host of a PostgreSQL URL's host list, with the default port and
    one name for the loopback."""
    if host.startswith("[") and "]" in host:  # [IPv6]:PORT
        name, rest = host[1:host.index("]")], host[host.index("]") + 1:]
        port = rest[1:] if rest.startswith(":") else ""
    else:
        name, _, port = host.partition(":")
    name = name.lower()
    return f"{'localhost' if name in _LOOPBACK else name}:{port or _PG_PORT}"


def namespace_key(meta_url: str) -> str:
    """What two metadata URLs of one namespace have in common (no I/O): an SQLite database's
    resolved path; a PostgreSQL URL without its password (``password=`` parameters too), with
    ``postgresql://`` for ``postgres://``, each host with its port (5432 where none is given)
    and ``localhost`` for the loopback (``127.0.0.1``, ``[::1]``). A URL no engine takes is its
    own key. Two spellings that differ otherwise (another name of the host, a bind mount of the
    database's directory) are told apart by what the namespace holds (:func:`same_namespace`)."""
    from urllib.parse import urlsplit, urlunsplit

    from ..meta import meta_path, meta_scheme

    try:
        if meta_scheme(meta_url) == "sqlite":
            return "sqlite://" + os.path.realpath(meta_path(meta_url))
        parts = urlsplit(meta_url)
        userinfo, at, hosts = parts.netloc.rpartition("@")
        user = userinfo.split(":", 1)[0] + "@" if at else ""
        hosts = ",".join(_pg_host(h) for h in hosts.split(","))
        query = "&".join(sorted(q for q in parts.query.split("&") if q and not q.split("=", 1)[0].endswith("password")))
        return urlunsplit(("postgresql", user + hosts, parts.path, query, ""))
    except (IrdmaError, ValueError):
        return meta_url


#: The xattr of an irdma mount's root that says what the mount shows (:data:`irdma.fs.control.XATTR_MOUNT`).
MOUNT_XATTR = "user.irdma.mount"
#: Seconds a command waits for a mount to answer :data:`MOUNT_XATTR` (a hung mount) before it
#: reads the mount's record instead.
ASK_MOUNT_S = 5.0


def ask_mount(mountpoint: str, timeout: float = ASK_MOUNT_S) -> dict[str, object] | None:
    """What the irdma mount on ``mountpoint`` says it shows: its root's xattr
    ``user.irdma.mount`` (:meth:`irdma.fs.control.Control.mount_xattr`: ``source`` as the mount
    table shows it, ``subdir``, and its session ``session``, ``host``, ``pid``), which every user
    who may read the root directory may read, whatever user mounted it.

    Returns None when the mount does not answer within ``timeout`` seconds (the request goes to
    the mount: a hung one is left to itself, in a daemon thread), has no such xattr (an older
    irdma) or may not be asked (no read permission on its root)."""
    import json
    import threading

    got: list[dict[str, object]] = []

    def ask() -> None:
        try:
            shown = json.loads(os.getxattr(mountpoint, MOUNT_XATTR))
        except (OSError, ValueError):
            return
        if isinstance(shown, dict):
            got.append(shown)

    asking = threading.Thread(target=ask, name=f"ask {mountpoint}", daemon=True)
    asking.start()
    asking.join(timeout)
    return got[0] if got else None


def same_namespace(meta_url: str, shown: dict[str, object]) -> bool:
    """Whether ``meta_url`` opens the namespace of the mount that said ``shown``
    (:func:`ask_mount`): its metadata holds that mount's live session (its id, host and
    process). For URLs whose text differs (:func:`namespace_key`) but may name one namespace;
    False when it cannot be opened or ``shown`` names no session (a mount's record)."""
    from ..meta import open_meta

    sid, host, pid = shown.get("session"), shown.get("host"), shown.get("pid")
    if not (isinstance(sid, int) and sid > 0 and isinstance(host, str) and isinstance(pid, int)):
        return False
    try:
        store = open_meta(meta_url)
    except (IrdmaError, ValueError, OSError):
        return False
    try:
        return any(s.sid == sid and s.host == host and s.pid == pid for s in store.sessions())
    except (IrdmaError, OSError):
        return False
    finally:
        store.close()


@dataclass(frozen=True)
class Target:
    """What a path given to a command names: a path in a namespace.

    Attributes:
        path: the path in the namespace (a ``--subdir`` mount's directory included).
        meta_url: the namespace's metadata URL: the mount's, for a path under a mount (as
            ``--meta`` gives it when it was given), else the URL the command was given.
        mount: the irdma mountpoint the path lies under, or None.
        subdir: the directory of the namespace that mount shows as its root (``/``: all of it).
    """

    path: str
    meta_url: str
    mount: str | None = None
    subdir: str = "/"


def resolve_target(path: str, meta_url: str, explicit: bool, *, named_by: str = "--meta",
                   table: list[IrdmaMount] | None = None,
                   record: Callable[[str], dict[str, object] | None] | None = None,
                   ask: Callable[[str], dict[str, object] | None] | None = None) -> Target:
    """The namespace and the path in it that ``path`` names (see :class:`Target`).

    A path under an irdma mount names the mount's namespace (the metadata URL in the mount
    table) and a path in the directory the mount shows (``--subdir``): what the mount itself
    says (:func:`ask_mount`: any user who may read its root), else what its record says
    (:func:`irdma._proc.read_mount_record`: the mount's user's own). Any other path is a
    path in the namespace of ``meta_url``.

    Args:
        meta_url: the URL the command was given (``--meta``, ``$IRDMA_META`` or the default).
        explicit: ``meta_url`` was given on the command line (``--meta``): a path under a mount
            of another namespace is an error then. Else (``$IRDMA_META``, the default cluster)
            the mount's namespace is used.
        named_by: what named ``meta_url``, for the error message.
        table: the irdma mounts (default: :func:`mount_table`).
        record: the record of a mountpoint (default: :func:`irdma._proc.read_mount_record`).
        ask: what a mountpoint says it shows (default: :func:`ask_mount`).

    Raises:
        InvalidArgument: ``path`` is under a mount of another namespace than ``meta_url``'s
            and ``explicit`` (another spelling of the mount's URL is the mount's namespace:
            :func:`namespace_key`, :func:`same_namespace`).
        IrdmaError: ``path`` is under an irdma mount whose source names no namespace, or
            that neither says what it shows nor has a record here (an older irdma's mount, of
            another user): which directory it shows is unknown, so nothing is done.
    """
    from .._proc import mount_record_file, read_mount_record
    from ..meta import redact

    table = mount_table() if table is None else table
    record = read_mount_record if record is None else record
    ask = ask_mount if ask is None else ask
    below, mountpoint = namespace_path(path, [m.mountpoint for m in table])
    if mountpoint is None:
        return Target(below, meta_url)
    entry = [m for m in table if m.mountpoint == mountpoint][-1]  # the topmost one there
    url = entry.meta_url
    if url is None:
        raise IrdmaError(f"{path} is under the irdma mount on {mountpoint}, whose source {entry.source!r} names"
                         " no namespace", "give the path in the namespace, with --meta URL")

    def of_this_mount(shown: dict[str, object] | None) -> dict[str, object] | None:
        ok = shown is not None and shown.get("source") == entry.source and isinstance(shown.get("subdir"), str)
        return shown if ok else None

    shown = of_this_mount(ask(mountpoint)) or of_this_mount(record(mountpoint))
    if explicit and namespace_key(meta_url) != namespace_key(url) \
            and not (shown is not None and same_namespace(meta_url, shown)):
        raise InvalidArgument(
            f"{path} is under the mount on {mountpoint} of {url}, but {named_by} names {redact(meta_url)}",
            "leave --meta out (a path under a mount names that mount's namespace),"
            " or give a path of the namespace you named without a mountpoint (/jobs/x)")
    if shown is None:
        raise IrdmaError(
            f"{path} is under the irdma mount on {mountpoint}, but which directory of {url} it shows is"
            f" unknown: the mount does not say ({MOUNT_XATTR} of its root: an older irdma's mount, or a root"
            f" this user may not read) and there is no record of it here ({mount_record_file(mountpoint)});"
            " nothing done",
            f"give the path in the namespace instead (such as /jobs/x/w) with --meta {url}, or mount it again")
    subdir = os.path.normpath("/" + str(shown["subdir"]).strip("/"))
    inside = os.path.normpath(os.path.join(subdir, below.lstrip("/")))
    return Target(inside, meta_url if explicit else url, mountpoint, subdir)
