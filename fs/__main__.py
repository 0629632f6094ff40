"""``python -m irdma.fs META_URL MOUNTPOINT``: the mount process (see irdma.fs.mount)."""

from __future__ import annotations

import argparse
import functools
import logging
import sys

import trio

from irdma._errors import IrdmaError
from irdma.client.cache import make_cache

from .mount import serve_mount
from .operations import ATTR_TIMEOUT, ENTRY_TIMEOUT


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m irdma.fs")
    ap.add_argument("meta_url")
    ap.add_argument("mountpoint")
    ap.add_argument("--transport", default="auto")
    ap.add_argument("--debug", action="store_true")
    ap.add_argument("--direct-io", action="store_true")
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds per shard request / metadata lock wait")
    ap.add_argument("--allow-other", action="store_true", help="let every user use the mount (FUSE allow_other)")
    ap.add_argument("--sync-timeout", type=float, default=60.0, help="seconds a .irdma barrier or lock wait may take")
    ap.add_argument("--metrics", default=None, metavar="HOST:PORT",
                    help="serve Prometheus metrics at http://HOST:PORT/metrics (port 0: a free one)")
    ap.add_argument("--read-only", action="store_true", help="refuse every change (EROFS); the kernel mounts it ro")
    ap.add_argument("--subdir", default=None, help="serve this directory of the namespace as the mount's root")
    ap.add_argument("--attr-cache", type=float, default=ATTR_TIMEOUT, help="seconds the kernel caches attributes")
    ap.add_argument("--entry-cache", type=float, default=ENTRY_TIMEOUT, help="seconds the kernel caches names")
    ap.add_argument("--cache-dir", default=None, help="the disk tier of the local read cache (irdma.client.cache)")
    ap.add_argument("--cache-size", default=None, help="bytes of the disk tier (default 10GiB)")
    ap.add_argument("--cache-memory", default=None, help="bytes of the memory tier (default 256MiB with --cache-dir, else 0)")
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        cache = make_cache(args.cache_dir, args.cache_size, args.cache_memory)
        trio.run(functools.partial(serve_mount, args.meta_url, args.mountpoint, transport=args.transport, debug=args.debug,
                                   direct_io=args.direct_io, timeout=args.timeout, allow_other=args.allow_other,
                                   metrics=args.metrics, sync_timeout=args.sync_timeout, read_only=args.read_only,
                                   subdir=args.subdir, attr_cache=args.attr_cache, entry_cache=args.entry_cache,
                                   cache=cache))
    except IrdmaError as exc:
        logging.getLogger("irdma.fs").error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
