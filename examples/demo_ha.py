#!/usr/bin/env python3
"""`make demo-ha`: irdma on a highly available metadata tier, and the primary's host killed
mid-training.

The hosts are network namespaces of this machine on one bridge (:mod:`irdma.ops.testbed`);
every process runs on its host with ``nsenter --net``:

* hosts 0-2: the metadata tier, an etcd member and a PostgreSQL 15 under Patroni on each,
  synchronous replication on (:mod:`irdma.ops.patroni`); clients use the multi-host URL
  ``postgresql://irdma@H0,H1,H2/irdma?target_session_attrs=read-write``;
* hosts 3-5: one shard each (``irdma server --meta URL``);
* hosts 6-7: one worker host each, with its own ``irdma mount URL MNT``.

The digits training of ``train_digits.py`` runs one worker on each worker host; when the
first worker passes a third of its steps, the primary's host is killed (every process SIGKILLed,
its link down). Patroni promotes the synchronous standby; the mounts, the shards and the
workers wait for it and go on; training finishes with the same accuracy bound as `make
demo-hosts` and a checkpoint restored bit-identically on the other host. `irdma status` shows the
tier before, during (exit 1: a member down) and after the killed host rejoins. Everything is
stopped and removed at the end, also on failure or Ctrl-C. Needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from demo_hosts import step, wait_for_shards  # noqa: E402


def main() -> int:
    from irdma._errors import IrdmaError
    from irdma.ops.patroni import PatroniCluster
    from irdma.ops.testbed import TestBed

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rate", default="1gbit", help="each host's link rate (tc units)")
    ap.add_argument("--capacity", default="256MiB")
    args = ap.parse_args()

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    work = tempfile.mkdtemp(prefix="irdma-ha-demo-")
    os.chmod(work, 0o755)
    t0 = time.monotonic()
    rc = 1
    bed = ha = None
    irdma = [sys.executable, "-m", "irdma.ops.cli"]
    try:
        step(f"building the test bed: 8 hosts on a bridge, links shaped to {args.rate}")
        bed = TestBed(8, rate=args.rate)
        for h in bed.hosts:
            role = "metadata (etcd + Patroni + PostgreSQL)" if h.index < 3 else "shard" if h.index < 6 else "worker"
            print(f"  host {h.index}: {h.address:<12} netns {h.netns}  ({role})")
        meta_hosts, shard_hosts, workers = bed.hosts[0:3], bed.hosts[3:6], bed.hosts[6:8]

        step("the metadata tier: etcd and Patroni on hosts 0-2, synchronous replication")
        t1 = time.monotonic()
        ha = PatroniCluster(bed, meta_hosts)
        os.environ["PGPASSFILE"] = ha.passfile  # inherited by every process below
        key = os.path.join(work, "cluster.key")
        os.environ["IRDMA_KEY_FILE"] = key
        url = ha.url
        print(f"  up in {time.monotonic() - t1:.0f} s; primary on host {ha.primary()}")
        for m in ha.members():
            print(f"  {m['name']}: {m['role']} ({m['state']}) at {m['host']}")
        print(f"  metadata URL {url} (password in {ha.passfile})")

        step("irdma format (on host 3)")
        bed.run(shard_hosts[0], [*irdma, "format", url, "--key-file", key, "--replicas", "2"], check=True)

        step("one shard on each of hosts 3-5")
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
        step("irdma status: the metadata tier healthy")
        bed.run(workers[0], [*irdma, "status", "--meta", url])
        run_dirs = [os.path.join(m, "digits") for m in mounts]

        step("training; the primary's host is killed when worker 0 passes a third of its steps")
        train = bed.popen(workers[0], [sys.executable, "-u", os.path.join(HERE, "train_digits.py"), "--run-dir",
                                       run_dirs[0], "--workers", "2", "--steps", str(args.steps),
                                       "--worker-run-dirs", ",".join(run_dirs),
                                       "--worker-netns", ",".join(h.netns for h in workers),
                                       "--restore-run-dir", run_dirs[1], "--restore-netns", workers[1].netns],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        third = threading.Event()
        lines: list[str] = []

        def pump() -> None:
            assert train.stdout is not None
            for line in train.stdout:
                print("  | " + line, end="", flush=True)
                lines.append(line)
                m = re.search(r"\[worker 0\] step (\d+)/", line)
                if m and int(m.group(1)) >= args.steps // 3:
                    third.set()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        if not third.wait(600):
            raise SystemExit("training did not reach a third of its steps within 600 s")
        old = ha.primary()
        killed = time.monotonic()
        ha.kill_host(old)
        print(f"  == killed metadata host {old} (the primary): its processes SIGKILLed, its link down", flush=True)
        new, _ = ha.wait_primary(exclude=[old], timeout=90)
        print(f"  == Patroni promoted host {new} {time.monotonic() - killed:.1f} s after the kill", flush=True)
        status = bed.run(workers[1], [*irdma, "status", "--meta", url], capture_output=True, text=True, timeout=120)
        print(status.stdout + status.stderr, end="")
        print(f"  == irdma status during the loss: exit {status.returncode} (1: a metadata member is down)", flush=True)
        rc = train.wait(900)
        reader.join(30)
        result = next((json.loads(x.split(" ", 1)[1]) for x in reversed(lines) if x.startswith("RESULT ")), None)
        print(f"  training exit {rc}; result {result}")

        step(f"the killed host comes back: host {old} rejoins as a standby")
        ha.restart_member(old)
        ha.wait_healthy(180)
        status = bed.run(workers[0], [*irdma, "status", "--meta", url], capture_output=True, text=True, timeout=120)
        print(status.stdout + status.stderr, end="")
        if status.returncode != 0:
            print(f"irdma status exits {status.returncode} after the rejoin", file=sys.stderr)
            rc = rc or 1
        print("RESULT " + json.dumps({"killed": old, "promoted": new, "rc": rc, "training": result}), flush=True)
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
    except IrdmaError as exc:  # the test bed or the tier could not start: what and why, no traceback
        print(f"step failed: {exc}", file=sys.stderr)
        rc = 1
    finally:
        step("stopping every process and removing the test bed")
        if bed is not None:
            bed.close()  # every process of the bed (mounts, shards, Patroni, etcd), then its namespaces
        if ha is not None:
            ha.close()
        shutil.rmtree(work, ignore_errors=True)
    print(f"\ndemo-ha {'passed' if rc == 0 else 'FAILED'} in {time.monotonic() - t0:.0f} s", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
