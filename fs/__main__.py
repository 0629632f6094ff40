"""``python -m irdma.fs META_URL MOUNTPOINT``: the mount process (see irdma.fs.mount); its
options and their defaults are :class:`irdma.fs.options.MountOptions`'."""

from __future__ import annotations

import argparse
import functools
import logging
import sys

import trio

from irdma._errors import IrdmaError
from irdma._proc import keep_freed_buffers
from irdma.client.cache import make_cache

from .mount import serve_mount
from .options import add_arguments, from_arguments


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m irdma.fs")
    ap.add_argument("meta_url")
    ap.add_argument("mountpoint")
    add_arguments(ap)
    args = ap.parse_args(argv)
    opts = from_arguments(args)
    logging.basicConfig(
        level=logging.DEBUG if opts.debug else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    keep_freed_buffers()
    try:
        cache = make_cache(opts.cache_dir, opts.cache_size, opts.cache_memory)
        trio.run(functools.partial(serve_mount, args.meta_url, args.mountpoint, **opts.serve_kwargs(), cache=cache))
    except IrdmaError as exc:
        logging.getLogger("irdma.fs").error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
