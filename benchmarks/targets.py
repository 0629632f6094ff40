"""The targets of ``make bench``: each ratio docs/benchmarks.md states against its baseline, the
value it is wanted at and in which direction, computed from one run's figures
(``benchmarks/run.py``'s results: the dictionary written to docs/benchmarks.json).

Shared by the report (benchmarks/report.py: the "Targets" table and the replication and
authentication tables) and the regression check (benchmarks/guard.py: each ratio beside the last
committed run's); it imports neither, so they do not import each other for it.
"""

from __future__ import annotations

from typing import Any

MiB = 1 << 20


def fmt_size(n: int) -> str:
    """A byte count as the tables write it: 1 GiB, 4 MiB, 256 KiB."""
    n = int(n)
    if n >= 1 << 30:
        return f"{n / (1 << 30):g} GiB"
    if n >= MiB:
        return f"{n / MiB:g} MiB"
    return f"{n / 1024:g} KiB"


# what the snapshot targets below, and each replication and authentication ratio, are wanted at
# (the report's tables and the guard)
SNAPSHOT_CREATE_WANTED = 100.0  # a snapshot at least this many times faster than a copy through the mount
SNAPSHOT_STEP_WANTED = 1.1  # a training step with a snapshot every second, over none, at most
SNAPSHOT_BYTES_WANTED = 1.05  # shard bytes over (1 + N f) x bytes x replicas, at most
REPLICATION_WANTED = (("pull", 0.95), ("push-assign", 0.5), ("push-add", 0.5))
AUTHENTICATION_WANTED = 0.9


def _section(what: str) -> str:
    """The ``--only`` section a target's figures come from ("main": only a full run measures it)."""
    for prefix, section in (("model round", "rounds"), ("fio ", "fio"), ("sparse rows", "rows"),
                            ("snapshot", "snapshots"), ("dd ", "dd"), ("shard bytes held", "smallfiles"),
                           ("small files", "smallfiles"), ("embedding", "embedding"),
                            ("4 KiB native read p50", "round_trip"), ("checkpoint", "ckpt")):
        if what.startswith(prefix):
            return section
    return "main"


def targets(R: dict[str, Any]) -> list[dict[str, Any]]:
    """Every target of the issue: what, ratio, baseline, target, met, figures, lower_is_better
    (a "<=" target: smaller is better) and section (what ``--only`` measures it again)."""
    out: list[dict[str, Any]] = []
    tcp, nat, mnt = R["tcp"], R["native"], R["mount"]

    def add(what: str, ratio: float, base: str, target: float, figures: str, lower_is_better: bool = False) -> None:
        met = ratio <= target if lower_is_better else ratio >= target
        out.append({"what": what, "ratio": ratio, "baseline": base, "target": target, "met": met, "figures": figures,
                    "lower_is_better": lower_is_better, "section": _section(what)})

    mac = R.get("tcp_mac")
    if mac:  # issue 41: the integrity level against the same work done on plain sockets
        base = "loopback TCP, 4 streams, a GMAC per 4 MiB block checked by the receiver (same-work ceiling)"
        add("native pull, over the same-work ceiling", nat["pull"] / mac["pull"], base, 0.8,
            f"{nat['pull']:.0f} vs {mac['pull']:.0f} MB/s")
        add("native push (assign), over the same-work ceiling", nat["push-assign"] / mac["push"], base, 0.7,
            f"{nat['push-assign']:.0f} vs {mac['push']:.0f} MB/s")
        add("native push (add), over the same-work ceiling", nat["push-add"] / mac["push"], base, 0.5,
            f"{nat['push-add']:.0f} vs {mac['push']:.0f} MB/s")
        fresh = R.get("tcp_fresh")
        if fresh:  # issue 41: a push that creates its chunks lands in memory the shard never held
            add("native push (assign) of new chunks, over the same-work ceiling into fresh memory",
                nat["push-assign"] / fresh["mac"], "the same-work ceiling, each stream's bytes received into a new"
                " file's shared mapping (fresh memory, as a shard's region)", 0.7,
                f"{nat['push-assign']:.0f} vs {fresh['mac']:.0f} MB/s")
        if "push-assign-existing" in nat:  # the same push once the chunks exist: memory already held
            add("native push (assign) of existing chunks, over the same-work ceiling",
                nat["push-assign-existing"] / mac["push"], base, 0.7,
                f"{nat['push-assign-existing']:.0f} vs {mac['push']:.0f} MB/s")
    else:  # a run from before the same-work ceiling: the raw loopback rows it had
        add("native pull", nat["pull"] / tcp["pull"], "loopback TCP, 4 streams", 0.8,
            f"{nat['pull']:.0f} vs {tcp['pull']:.0f} MB/s")
        add("native push (assign)", nat["push-assign"] / tcp["push"], "loopback TCP, 4 streams", 0.7,
            f"{nat['push-assign']:.0f} vs {tcp['push']:.0f} MB/s")
        add("native push (add)", nat["push-add"] / tcp["push"], "loopback TCP, 4 streams", 0.5,
            f"{nat['push-add']:.0f} vs {tcp['push']:.0f} MB/s")
    au = (R.get("authentication") or {}).get("auth")
    if au:  # --security auth tags no payload: its ceiling is raw loopback
        add("native pull, --security auth, over raw loopback TCP", au["pull"] / tcp["pull"],
            "loopback TCP, 4 streams", 0.8, f"{au['pull']:.0f} vs {tcp['pull']:.0f} MB/s")
        add("native push (assign), --security auth, over raw loopback TCP", au["push-assign"] / tcp["push"],
            "loopback TCP, 4 streams", 0.7, f"{au['push-assign']:.0f} vs {tcp['push']:.0f} MB/s")
    add("mount sequential read", mnt["pull"] / nat["pull"], "native client pull", 0.7,
        f"{mnt['pull']:.0f} vs {nat['pull']:.0f} MB/s")
    add("mount sequential write", mnt["push-assign"] / nat["push-assign"], "native client push (assign)", 0.5,
        f"{mnt['push-assign']:.0f} vs {nat['push-assign']:.0f} MB/s")
    r = R["rounds"]
    nat_u = r.get("irdma-native-unified", r["irdma-native"])
    mnt_u = r.get("irdma-mount-unified", r["irdma-mount"])
    add("model round, native (unified buffer) vs ParameterServerStrategy", r["tf-ps"] / nat_u,
        "TF PS round time (x faster)", 2.0, f"{nat_u * 1e3:.0f} vs {r['tf-ps'] * 1e3:.0f} ms")
    add("model round, native (unified buffer) vs Redis", r["redis"] / nat_u, "Redis round time (x faster)", 3.0,
        f"{nat_u * 1e3:.0f} vs {r['redis'] * 1e3:.0f} ms")
    add("model round, mount (unified buffer) vs ParameterServerStrategy", r["tf-ps"] / mnt_u,
        "TF PS round time (x faster)", 1.0, f"{mnt_u * 1e3:.0f} vs {r['tf-ps'] * 1e3:.0f} ms")
    if "irdma-mount" in r:  # issue 39: a framework's save of a file per tensor
        add("model round, a file per tensor, through the mount vs ParameterServerStrategy", r["tf-ps"] /
            r["irdma-mount"], "TF PS round time (x faster)", 1.0,
            f"{r['irdma-mount'] * 1e3:.0f} vs {r['tf-ps'] * 1e3:.0f} ms")
    if "bsp-round" in r:  # issue 38: BSP's one step per round costs at most 1.1x a step per push
        add("model round, BSP: one step per round on the summed pushes, over a step per push", r["bsp-round"] /
            r["bsp-push"], "BSP round, a step per worker's push", 1.1,
            f"{r['bsp-round'] * 1e3:.0f} vs {r['bsp-push'] * 1e3:.0f} ms", lower_is_better=True)
    worst = max(((rss - 100e6) / held if held else 0.0) for held, rss in
                ((int(k), v) for k, v in R["shard_rss"].items()) if held)
    rows = ", ".join(f"{fmt_size(int(k))} held: {v / 1e6:.0f} MB" for k, v in R["shard_rss"].items())
    add("shard RSS - 100 MB, over bytes held (worst point)", worst, "bytes held", 1.1, rows, lower_is_better=True)
    add("FUSE process peak RSS streaming 1 GiB, MB", R["fuse_rss_peak"] / 1e6, "absolute", 300.0,
        f"{R['fuse_rss_peak'] / 1e6:.0f} MB", lower_is_better=True)
    ck = R["ckpt"]

    def fuse_ceiling(kind: str) -> str:
        """The passthrough's figure for ``kind`` (save, restore), where the run has it."""
        if f"passthrough_{kind}_s" not in ck:
            return ""
        pt_s = ck[f"passthrough_{kind}_s"]
        return f"; the FUSE ceiling, a pyfuse3 passthrough of tmpfs: {pt_s:.2f} s, {pt_s / ck[f'tmpfs_{kind}_s']:.2f}"

    add("checkpoint save, mount over tmpfs", ck["mount_save_s"] / ck["tmpfs_save_s"], "tmpfs", 1.5,
        f"{ck['mount_save_s']:.2f} vs {ck['tmpfs_save_s']:.2f} s{fuse_ceiling('save')}", lower_is_better=True)
    add("checkpoint restore, mount over tmpfs", ck["mount_restore_s"] / ck["tmpfs_restore_s"], "tmpfs", 1.5,
        f"{ck['mount_restore_s']:.2f} vs {ck['tmpfs_restore_s']:.2f} s{fuse_ceiling('restore')}", lower_is_better=True)
    if "passthrough_restore_s" in ck:  # what a FUSE mount can be asked for: the passthrough's own restore
        add("checkpoint restore, mount over a pyfuse3 passthrough of tmpfs", ck["mount_restore_s"] /
            ck["passthrough_restore_s"], "pyfuse3 passthrough of tmpfs", 1.5,
            f"{ck['mount_restore_s']:.2f} vs {ck['passthrough_restore_s']:.2f} s", lower_is_better=True)
    fio = R.get("fio")
    if fio:
        pt, mn = fio["pyfuse3 passthrough of tmpfs"], fio["irdma mount"]
        for what, key, field, want in (("fio seq read 1 MiB, 4 jobs, mount over passthrough", "seq read 1 MiB x4", "mb_s", 0.6),
                                       ("fio seq write 1 MiB, 4 jobs, mount over passthrough", "seq write 1 MiB x4", "mb_s", 0.6),
                                       ("fio rand read 4 KiB, 16 jobs, mount over passthrough", "rand read 4 KiB x16", "iops",
                                        0.5)):
            if key in mn and key in pt:
                unit = "MB/s" if field == "mb_s" else "IOPS"
                add(what, mn[key][field] / pt[key][field], "minimal pyfuse3 passthrough of tmpfs", want,
                    f"{mn[key][field]:.0f} vs {pt[key][field]:.0f} {unit}")
    dd = R.get("dd")
    if dd:  # issue 39: small writes gathered into chunk-sized pushes
        m, p = dd["mount"], dd["passthrough"]
        add(f"dd bs=4k / dd bs=1M into the mount, {fmt_size(dd['size'])}", m["4k"] / m["1M"], "dd bs=1M into the mount",
            0.5, f"{m['4k']:.0f} vs {m['1M']:.0f} MB/s (the FUSE ceiling, a pyfuse3 passthrough of tmpfs:"
            f" {p['4k']:.0f} vs {p['1M']:.0f} MB/s, {p['4k'] / p['1M']:.2f})")
    sf = R.get("smallfiles")
    if sf:  # issue 39: space follows the bytes
        stored = sf["files"] * sf["size"] * sf["replicas"]
        add(f"shard bytes held by {sf['files']:,} files of {fmt_size(sf['size'])}, {sf['replicas']} replicas, over"
            " their bytes x replicas", sf["held"] / stored, "the files' bytes x replicas", 2.0,
            f"{fmt_size(sf['held'])} held for {fmt_size(stored)} (wanted <= 64 MiB)", lower_is_better=True)
        tm = sf.get("timed")
        if tm:
            add(f"small files: {tm['files']:,} of {fmt_size(tm['size'])} written then read, mount time over native"
                " client time", tm["mount_s"] / tm["native_s"], "the native client's time", 2.0,
                f"{tm['mount_s']:.1f} vs {tm['native_s']:.1f} s ({tm['mount_s'] / tm['files'] * 1e3:.1f} vs"
                f" {tm['native_s'] / tm['files'] * 1e3:.1f} ms a file)", lower_is_better=True)
    rt = R.get("round_trip")
    if rt:
        add("4 KiB native read p50, over a Python socket ping-pong", rt["irdma_p50_us"] / rt["socket_p50_us"],
            "Python socket ping-pong p50 (4 KiB answer)", 2.5,
            f"{rt['irdma_p50_us']:.0f} vs {rt['socket_p50_us']:.0f} us (p99 {rt['irdma_p99_us']:.0f} vs"
            f" {rt['socket_p99_us']:.0f} us)", lower_is_better=True)
    rw = R.get("rows")
    if rw:
        add("sparse rows pull, 10,000 of 256 float32, native", rw["pull_ratio"], "contiguous pull of the same bytes",
            0.5, f"{rw['rows-pull']['mb_s']:.0f} vs {rw['contig-pull']['mb_s']:.0f} MB/s")
        add("sparse rows push (add), 10,000 of 256 float32, native", rw["add_ratio"],
            "contiguous push (add) of the same bytes", 0.4,
            f"{rw['rows-add']['mb_s']:.0f} vs {rw['contig-add']['mb_s']:.0f} MB/s")
        z = rw.get("zipf")
        if z:  # issue 40
            add("sparse rows pull, Zipf ids, native", z["pull_ratio"], "contiguous pull of the distinct rows' bytes", 0.6,
                f"{z['rows-pull']['seconds'] * 1e3:.1f} vs {z['contig-pull']['seconds'] * 1e3:.1f} ms,"
                f" {z['distinct']:.0f} distinct of {rw['picked']:,}")
            add("sparse rows push (add), Zipf ids, native", z["add_ratio"], "contiguous push (add) of the distinct rows'"
                " bytes", 0.5, f"{z['rows-add']['seconds'] * 1e3:.1f} vs {z['contig-add']['seconds'] * 1e3:.1f} ms")
    em = R.get("embedding")
    if em:  # issue 40
        add("embedding training rows/s vs TF ParameterServerStrategy", em["ratio_irdma_over_tf_ps"],
            "ParameterServerStrategy rows/s (same model, data, batch; 2 workers)", 1.5,
            f"{em['irdma']['rows_per_s']:.0f} vs {em['tf_ps']['rows_per_s']:.0f} rows/s")
    sn = R.get("snapshots")
    if sn:
        for key, what in (("file", f"a {fmt_size(sn['create']['file']['bytes'])} file"),
                          ("tensors", f"ResNet-50's {sn['create']['tensors']['files']} tensors")):
            c = sn["create"][key]
            snap = max(c["snapshot_native"], c["snapshot_mount"])  # the slower of the two ways
            add(f"snapshot of {what}, x faster than a copy through the mount", c["copy_mount"] / snap,
                f"{c['copy_mount_how']} through the mount", SNAPSHOT_CREATE_WANTED,
                f"{snap * 1e3:.0f} ms vs {c['copy_mount']:.1f} s")
        st = sn["step"]
        add("snapshot every second while 2 workers train, step time over none", st["ratio"],
            "the same training, no snapshots", SNAPSHOT_STEP_WANTED,
            f"{st['round_s_every_1s'] * 1e3:.0f} vs {st['round_s_none'] * 1e3:.0f} ms"
            + (f" from {st['settle_s']:.0f} s into a phase on ({st['ratio_all_rounds']:.2f}x over every round)"
               if "settle_s" in st else "")
            + f" ({st['snapshots_taken']} taken, {st.get('snapshots_failed', 0)} refused)", lower_is_better=True)
        bh = sn["bytes_held"]
        add(f"snapshots: shard bytes after {bh['snapshots']}, {bh['f']:.0%} rewritten after each, over (1 + N f) x"
            " bytes x replicas", bh["ratio"], "ZFS's cost model", SNAPSHOT_BYTES_WANTED,
            f"{bh['file_used'] / 1e6:.0f} vs {bh['expected'] / 1e6:.0f} MB", lower_is_better=True)
    return out
