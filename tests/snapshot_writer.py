"""One writer of tests/test_snapshot_consistency.py, in its own process: pushes ``add`` of 1.0
at element ``WRITER`` (and at the same element of every chunk of the file) into the files in
turn, through a mount (pwrite + fsync) or the native client (push), and records each push's
start and acknowledgement on the machine's monotonic clock (shared by all processes).

Usage: python snapshot_writer.py WRITER (mount:DIR | native:META_URL:DIR) FILES PUSHES FILE_BYTES OUT.json
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

CHUNK = 4096


def main() -> None:
    writer, where, files, pushes, size, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), \
        int(sys.argv[5]), sys.argv[6]
    w = int(writer)
    vec = np.zeros(size // 4, "<f4")
    vec[w :: CHUNK // 4] = 1.0  # element w of every chunk: a push touches every chunk of the file
    log: list[tuple[int, float, float]] = []
    kind, _, rest = where.partition(":")
    if kind == "mount":
        fds = [os.open(os.path.join(rest, f"f{k}"), os.O_RDWR) for k in range(files)]
        for n in range(pushes):
            k = n % files
            t0 = time.monotonic()
            os.pwrite(fds[k], vec.tobytes(), 0)
            os.fsync(fds[k])
            log.append((k, t0, time.monotonic()))
        for fd in fds:
            os.close(fd)
    else:
        import irdma

        url, _, d = rest.rpartition(":")
        with irdma.connect(url, transport="tcp") as c:
            for n in range(pushes):
                k = n % files
                t0 = time.monotonic()
                c.push(f"{d}/f{k}", vec)
                log.append((k, t0, time.monotonic()))
    with open(out, "w") as f:
        json.dump(log, f)


if __name__ == "__main__":
    main()
