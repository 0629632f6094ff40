"""What the benchmarks of ``make bench`` share: a local cluster and a mount for the length of a
``with`` block, the model the training rounds push (ResNet-50's variable shapes) and the chunk
size each of its tensors gets, and the start barrier of worker processes.

``benchmarks/run.py`` (the whole suite), ``benchmarks/rows.py`` and ``benchmarks/snapshots.py``
(sections that also run on their own) import it; it imports no other benchmark, so no benchmark
module imports ``run.py`` and there is no cycle among them. Everything runs on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from irdma.fs.mount import spawn_mount, unmount  # noqa: E402

from irdma.ops import cluster as C  # noqa: E402

MiB = 1 << 20
PY = sys.executable


@contextlib.contextmanager
def cluster(shards: int, capacity: int, replicas: int = 1, durability: str = "fsync",
            dirs: list[str] | None = None, security: str | None = None) -> Iterator[tuple[str, list[C.ShardProc]]]:
    """A local cluster of ``shards`` shard processes of ``capacity`` bytes each (TCP), stopped
    and removed when the block ends; yields its metadata URL and its shard processes. One
    replica unless asked (the replication section compares); ``security``: the level of its key
    file (None: the default, integrity); ``dirs``: a list the cluster's directory is appended to
    (to restart its shards with ``irdma.ops.cluster.up``)."""
    d = tempfile.mkdtemp(prefix="irdma-bench-")
    if dirs is not None:
        dirs.append(d)
    try:
        url = C.up(d, shards, capacity, transport="tcp", fresh=True, replicas=replicas, durability=durability,
                   security=security)
        yield url, C.read_state(d)
    finally:
        with contextlib.suppress(Exception):
            C.down(d)
        shutil.rmtree(d, ignore_errors=True)


@contextlib.contextmanager
def mounted(meta: str, direct_io: bool = False) -> Iterator[tuple[str, int]]:
    """A mount of the namespace ``meta`` (TCP; page cache on unless ``direct_io``) on a new
    temporary directory, unmounted when the block ends; yields its mountpoint and its pid."""
    d = tempfile.mkdtemp(prefix="irdma-bench-mnt-")
    mp = os.path.join(d, "m")
    os.makedirs(mp)
    pid = spawn_mount(meta, mp, transport="tcp", log_file=os.path.join(d, "mount.log"), direct_io=direct_io)
    try:
        yield mp, pid
    finally:
        with contextlib.suppress(Exception):
            unmount(mp)
        shutil.rmtree(d, ignore_errors=True)


def model_shapes() -> list[list[int]]:
    """ResNet-50's variables (25.6 million float32), from Keras with no weights downloaded (in a
    child process: TensorFlow stays out of this one)."""
    code = ("import os, json; os.environ['TF_CPP_MIN_LOG_LEVEL']='3'\nimport keras\n"
            "print(json.dumps([list(v.shape) for v in keras.applications.ResNet50(weights=None).weights]))")
    res = subprocess.run([PY, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def pow2_chunk(nbytes: int) -> int:
    """The chunk size of a tensor file of ``nbytes`` bytes: the smallest power of two from 64 KiB
    that holds it, at most 4 MiB."""
    c = 64 * 1024
    while c < nbytes and c < 4 * MiB:
        c *= 2
    return c


def start_together(procs: list[subprocess.Popen[str]], start: str, timeout: float = 120.0) -> None:
    """Wait until every worker said it is ready (a file ``START.ready.RANK`` each), then give the
    start signal (the file ``start``): a barrier of worker processes.

    Raises:
        RuntimeError: a worker exited, or not all were ready within ``timeout`` seconds.
    """
    deadline = time.monotonic() + timeout
    while len(glob.glob(start + ".ready.*")) < len(procs):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise RuntimeError("workers did not get ready")
        time.sleep(0.01)
    open(start, "w").close()


def cleanup_barrier(start: str) -> None:
    """Remove the files of the barrier ``start`` (its start signal and the workers' ready files)."""
    for f in [start, *glob.glob(start + ".ready.*")]:
        with contextlib.suppress(OSError):
            os.unlink(f)
