"""A drain keeps snapshot chunks shared (issue 36, point 8).

A snapshot's chunks share the live file's extents on a shard. A drain (or rebalance) used to
copy each key on its own, so the target took one extent per snapshot: an 8 MiB file with 10
snapshots needed 88 MiB where 8 were held, and the drain failed "shard is full". A move now
copies a shared extent once and the other keys share it on the target (:meth:`Shard.replace`),
and copy-on-write still parts them on the next write.
"""

from __future__ import annotations

import numpy as np
import pytest
import trio
from helpers import irdma_cli, running_cluster

import irdma

pytestmark = [pytest.mark.slow]

MB = 1 << 20


def test_draining_a_file_and_its_snapshots_fits_where_their_bytes_fit(tmp_path: object) -> None:
    """Two shards of 32 MiB, no replicas: an 8 MiB file (1 MiB chunks, 4 on each shard) and 10
    snapshots of it. Draining shard 1 into shard 2 needs 8 MiB there if the snapshots stay
    shared (44 MiB of copies if not, more than it has): it finishes, shard 2 holds 8 MiB,
    every snapshot and the file read exact, and a push to the file after the drain leaves the
    snapshots as they were."""
    n = 8 * MB // 4
    w = np.arange(n, dtype="<f4")
    with running_cluster(str(tmp_path / "c"), shards=2, capacity=32 * MB, replicas=1) as c:  # type: ignore[operator]
        async def before() -> None:
            async with irdma.Client.open(c.meta_url, transport="tcp") as cl:
                await cl.write("/m", w, chunk_size=MB)
                for k in range(10):
                    await cl.snapshot("/", f"s{k}")

        trio.run(before)
        res = irdma_cli("shard", "drain", "1", "--meta", c.meta_url, check=False)
        assert res.returncode == 0, res.stdout + res.stderr

        async def after() -> dict[int, int]:
            async with irdma.Client.open(c.meta_url, transport="tcp") as cl:
                used = {rec.shard_id: st.used for rec, st, _ in await cl.shard_stats() if st is not None}
                for path in ["/m"] + [f"/.snapshots/s{k}/m" for k in range(10)]:
                    assert np.array_equal(await cl.pull(path), w), path
                await cl.push("/m", np.ones(n, "<f4"))
                assert np.array_equal(await cl.pull("/m"), w + 1)
                for k in range(10):
                    assert np.array_equal(await cl.pull(f"/.snapshots/s{k}/m"), w), k
                return used

        used = trio.run(after)
        assert used[2] == 8 * MB, used
