#!/usr/bin/env python3
"""`make demo-hosts`: irdma across six hosts, with PostgreSQL metadata.

The hosts are network namespaces of this machine on one bridge, each link shaped to
``--rate`` (see :mod:`irdma.ops.testbed`); every process runs on its host with ``nsenter --net``:

* host 0: PostgreSQL 15 (the metadata), ``irdma format`` makes the namespace and the key;
* hosts 1-3: one shard each, ``irdma server --listen ADDR --meta URL --data-dir DIR``;
* hosts 4-5: one worker host each, with its own ``irdma mount URL MNT``.

Then the digits training of ``train_digits.py`` runs one worker on each worker host, sharing
parameters only through their mounts; the coordinator on host 4 saves a checkpoint, and a
fresh process on host 5 restores it through its own mount and checks the weights are
bit-identical. Every host's processes are listed, then everything is stopped and removed
(also on failure or Ctrl-C). Needs root.

The PostgreSQL password is in a libpq password file (``PGPASSFILE``), never on a command line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def step(msg: str) -> None:
    print(f"\n==> {msg}", flush=True)


def main() -> int:
    from irdma.ops.testbed import PostgresServer, TestBed

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rate", default="1gbit", help="each host's link rate (tc units)")
    ap.add_argument("--capacity", default="256MiB")
    args = ap.parse_args()

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    work = tempfile.mkdtemp(prefix="irdma-hosts-")
    os.chmod(work, 0o755)
    t0 = time.monotonic()
    rc = 1
    bed = pg = None
    irdma = [sys.executable, "-m", "irdma.ops.cli"]
    try:
        step(f"building the test bed: 6 hosts on a bridge, links shaped to {args.rate}")
        bed = TestBed(6, rate=args.rate)
        for h in bed.hosts:
            role = {0: "PostgreSQL", 4: "worker A", 5: "worker B"}.get(h.index, "shard")
            print(f"  host {h.index}: {h.address:<12} netns {h.netns}  ({role})")
        pg_host, shard_hosts, workers = bed.hosts[0], bed.hosts[1:4], bed.hosts[4:6]

        step(f"PostgreSQL 15 on host 0 ({pg_host.address}:5432)")
        pg = PostgresServer(listen=pg_host.address, port=5432, prefix=pg_host.nsenter)
        os.environ["PGPASSFILE"] = pg.passfile  # inherited by every process below
        key = os.path.join(work, "cluster.key")
        os.environ["IRDMA_KEY_FILE"] = key
        url = pg.url
        print(f"  metadata URL {url} (password in {pg.passfile})")

        step("irdma format (on host 1)")
        bed.run(shard_hosts[0], [*irdma, "format", url, "--key-file", key, "--replicas", "2"], check=True)

        step("one shard on each of hosts 1-3 (irdma server --meta: each registers itself)")
        for h in shard_hosts:
            log = open(os.path.join(work, f"shard-{h.index}.log"), "w")
            bed.popen(h, [*irdma, "server", "--listen", f"{h.address}:7700", "--meta", url, "--transport", "tcp",
                          "--data-dir", os.path.join(work, f"shard-{h.index}"), "--capacity", args.capacity,
                          "--key-file", key], stdout=log, stderr=subprocess.STDOUT)
        wait_for_shards(bed, workers[0], irdma, url, [f"{h.address}:7700" for h in shard_hosts])

        step("a mount on each worker host")
        mounts = []
        for h in workers:
            mnt = os.path.join(work, f"mnt-{h.index}")
            os.makedirs(mnt)
            bed.track_mount(mnt)
            bed.run(h, [*irdma, "mount", url, mnt, "--transport", "tcp", "--key-file", key], check=True)
            mounts.append(mnt)
            print(f"  host {h.index}: {mnt}")
        run_dirs = [os.path.join(m, "digits") for m in mounts]

        step("training: one worker on each worker host, parameters shared only through the mounts")
        res = bed.run(workers[0], [sys.executable, os.path.join(HERE, "train_digits.py"), "--run-dir", run_dirs[0],
                                   "--workers", "2", "--steps", str(args.steps),
                                   "--worker-run-dirs", ",".join(run_dirs),
                                   "--worker-netns", ",".join(h.netns for h in workers),
                                   "--restore-run-dir", run_dirs[1], "--restore-netns", workers[1].netns],
                      timeout=900)
        rc = res.returncode

        step("the cluster after training")
        bed.run(workers[0], [*irdma, "shard", "list", "--meta", url])
        bed.run(workers[0], [*irdma, "status", "--meta", url])
        step("every host's processes")
        for ns, rows in bed.processes().items():
            print(f"  {ns}:")
            for row in rows:
                print(f"    {row}")
        print("RESULT " + json.dumps({"hosts": {h.netns: h.address for h in bed.hosts}, "rc": rc}), flush=True)
        step("unmounting")
        for h, mnt in zip(workers, mounts, strict=True):
            if bed.run(h, [*irdma, "umount", mnt]).returncode != 0:
                rc = rc or 1
    except KeyboardInterrupt:
        print("\ninterrupted: cleaning up", file=sys.stderr)
        rc = 130
    except subprocess.CalledProcessError as exc:
        print(f"step failed: {exc}", file=sys.stderr)
        rc = 1
    finally:
        step("stopping every process and removing the test bed")
        if bed is not None:
            bed.close()  # first: mounts and shards stop while their database still answers
        if pg is not None:
            pg.close()
        shutil.rmtree(work, ignore_errors=True)
    print(f"\ndemo-hosts {'passed' if rc == 0 else 'FAILED'} in {time.monotonic() - t0:.0f} s", flush=True)
    return rc


def wait_for_shards(bed: object, host: object, irdma: list[str], url: str, addresses: list[str],
                    deadline_s: float = 60) -> None:
    """Wait until `irdma shard list` on ``host`` shows every shard of ``addresses`` up (a deadline,
    no fixed sleep)."""
    end = time.monotonic() + deadline_s
    delay = 0.2
    while True:
        res = bed.run(host, [*irdma, "shard", "list", "--meta", url], capture_output=True, text=True)  # type: ignore[attr-defined]
        rows = res.stdout.splitlines()
        if res.returncode == 0 and all(any(a in r and " up " in r for r in rows) for a in addresses):
            print(res.stdout, end="")
            return
        if time.monotonic() > end:
            raise SystemExit(f"the shards did not all come up within {deadline_s:.0f} s:\n{res.stdout}{res.stderr}")
        time.sleep(delay)
        delay = min(1.0, delay * 1.5)


if __name__ == "__main__":
    sys.exit(main())
