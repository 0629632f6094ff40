"""Turn one benchmark run into docs/benchmarks.md, docs/benchmarks.json and PNG plots.

The targets and what they are wanted at come from benchmarks/targets.py, the "Regression check"
section from benchmarks/guard.py (neither imports this module).
"""

from __future__ import annotations

import json
import os
from typing import Any

from guard import markdown
from targets import AUTHENTICATION_WANTED, REPLICATION_WANTED, fmt_size, targets


def _at(commit: dict[str, Any] | None) -> str:
    """The words ' at commit 9eb39bf' (and whether the tree had uncommitted changes), or none."""
    if not commit:
        return ""
    return f" at commit {commit['hash'][:7]}" + (" with uncommitted changes" if commit.get("dirty") else "")


def _snapshots_section(sn: dict[str, Any], date: str | None) -> list[str]:
    """The "Snapshots" section: create time, training while taking them, bytes held."""
    cr, st, bh = sn["create"], sn["step"], sn["bytes_held"]
    L = ["## Snapshots (issue 23)", "",
         f"`benchmarks/snapshots.py`: {sn['shards']} shards, {sn['replicas']} replicas (each shard holds every chunk),"
         " one mount" + (f" (measured again on {date}, `benchmarks/run.py --only snapshots`)" if date else "") + ".",
         "A snapshot through the native client (`Client.snapshot`) and through the mount (`mkdir DIR/.snapshots/NAME`)"
         " against copying the same directory: through the mount, and with `cp -r` on tmpfs. The 1 GiB file is copied"
         " through the mount with 4 MiB reads and writes: `cp` (coreutils 9) calls copy_file_range(2) there, which"
         " the mount does not implement, and the kernel's fallback splices it page by page (2 to 7 MB/s on this host)."
         " Medians; seconds.", "",
         "| directory | snapshot, native | snapshot, mount | copy through the mount | `cp -r` on tmpfs |"
         " copy through the mount / slower snapshot |", "|---|---|---|---|---|---|"]
    for key in ("file", "tensors"):
        c = cr[key]
        snap = max(c["snapshot_native"], c["snapshot_mount"])
        L.append(f"| {c['path']}: {c['files']} file{'s' if c['files'] > 1 else ''}, {c['bytes'] / 1e6:,.0f} MB |"
                 f" {c['snapshot_native']:.3f} ({len(c['runs']['snapshot_native'])} runs) |"
                 f" {c['snapshot_mount']:.3f} ({len(c['runs']['snapshot_mount'])}) |"
                 f" {c['copy_mount']:.2f} ({c['copy_mount_how']}, {len(c['runs']['copy_mount'])}) |"
                 f" {c['cp_tmpfs']:.3f} ({len(c['runs']['cp_tmpfs'])}) | {c['copy_mount'] / snap:.0f}x |")
    took = f"median {st['snapshot_s_median'] * 1e3:.0f} ms, longest {st['snapshot_s_max'] * 1e3:.0f} ms" \
        if st.get("snapshot_s_median") is not None else "none completed"
    dele = f"; deleting the oldest took a median of {st['delete_s_median'] * 1e3:.0f} ms" \
        if st.get("delete_s_median") is not None else ""
    L += ["", f"Training: 2 worker processes, each round a push (`add`) into each of the {sn['tensors']} tensors then a"
          " pull of each (native client, `benchmarks/workers.py irdma-native`), with a snapshot of the directory every"
          f" second (the oldest deleted beyond 2) against none, in one run of {st['rounds']} rounds with phases of"
          f" {st.get('phase_s', 8):.0f} s of each alternating ({st.get('phases', 0)} phases; the machine drifts as much"
          f" as the effect between runs); means: {st['round_s_every_1s'] * 1e3:.0f} ms a round against"
          f" {st['round_s_none'] * 1e3:.0f} ms ({st['ratio']:.2f}x)"
          + (f", the rounds that start {st['settle_s']:.0f} s or more into their phase (the steady state:"
             f" {st['rounds_steady']['every_1s']} and {st['rounds_steady']['none']} rounds; over every round:"
             f" {st['ratio_all_rounds']:.2f}x: a phase's first snapshots copy onto memory the shards have not"
             " touched lately, and a phase without starts with the copy-on-write of the last one)"
             if "rounds_steady" in st else "")
          + f". Snapshots made: {st['snapshots_taken']}"
          f" ({took}{dele}); refused: {st.get('snapshots_failed', 0)}"
          + (f" (first: {st['failures'][0]})" if st.get("failures") else "") + ".",
          "", f"Bytes held: {bh['snapshots']} snapshots of the {fmt_size(bh['file_bytes'])} file, {bh['f']:.0%} of its"
          f" {bh['chunks']} chunks rewritten (assign) after each: the shards hold {bh['file_used'] / 1e6:.0f} MB for"
          f" the file against (1 + N f) x bytes x replicas = {bh['expected'] / 1e6:.0f} MB ({bh['ratio']:.3f}x);"
          f" {bh['used_after_delete'] / 1e6:.0f} MB after deleting the snapshots ({bh['used_before'] / 1e6:.0f} MB"
          " before them).", ""]
    return L


def plots(R: dict[str, Any], out: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, key, xlabel, fmt in (
        (axes[0][0], "by_shards", "shards", str),
        (axes[0][1], "by_chunk", "chunk size", lambda k: fmt_size(int(k))),
        (axes[1][0], "by_size", "file size", lambda k: fmt_size(int(k))),
        (axes[1][1], "by_workers", "concurrent client processes", str),
    ):
        data = R[key]
        xs = list(data)
        for test, style in (("pull", "o-"), ("push-assign", "s--")):
            ax.plot(range(len(xs)), [data[x][test] for x in xs], style, label=test)
        ax.axhline(R["tcp"]["pull"], color="gray", lw=0.8, ls=":", label="loopback TCP pull (4 streams)")
        ax.set_xticks(range(len(xs)), [fmt(x) for x in xs])
        ax.set_xlabel(xlabel)
        ax.set_ylabel("MB/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("irdma native client bandwidth: how it grows")
    fig.tight_layout()
    path = os.path.join(out, "bench-scaling.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    files.append(path)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    r = R["rounds"]
    names = [n for n in ("irdma-native-unified", "irdma-mount-unified", "irdma-native", "irdma-mount", "tf-ps", "redis")
             if n in r]
    colors = {"irdma-native-unified": "#185", "irdma-mount-unified": "#5a3", "irdma-native": "#2a7",
              "irdma-mount": "#7c5", "tf-ps": "#48c", "redis": "#c55"}
    ax1.bar([n.replace("irdma-", "").replace("-unified", "\nunified") for n in names], [r[n] * 1e3 for n in names],
            color=[colors[n] for n in names])
    ax1.set_ylabel("ms per push-and-pull round (lower is better)")
    ax1.set_title("25.6 M float32 model, 2 workers, 2 servers")
    bw = {"TCP ceiling": (R["tcp"]["pull"], R["tcp"]["push"]),
          **({"TCP + GMAC": (R["tcp_mac"]["pull"], R["tcp_mac"]["push"])} if "tcp_mac" in R else {}),
          "irdma native": (R["native"]["pull"], R["native"]["push-assign"]),
          "irdma mount": (R["mount"]["pull"], R["mount"]["push-assign"]), "tmpfs": (R["tmpfs"]["read"], R["tmpfs"]["write"])}
    xs = list(bw)
    ax2.bar([i - 0.2 for i in range(len(xs))], [bw[x][0] for x in xs], 0.4, label="read / pull")
    ax2.bar([i + 0.2 for i in range(len(xs))], [bw[x][1] for x in xs], 0.4, label="write / push")
    ax2.set_xticks(range(len(xs)), xs)
    ax2.set_ylabel("MB/s")
    ax2.set_title("1 GiB sequential, 4 MiB requests")
    ax2.legend()
    fig.tight_layout()
    path = os.path.join(out, "bench-peers.png")
    fig.savefig(path, dpi=90)
    plt.close(fig)
    files.append(path)
    fio = R.get("fio")
    if fio:
        targets = list(fio)
        keys = [k for k in fio[targets[0]] if k.endswith(" x1") or k.endswith(" x16")]
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
        for ax, field, label in ((ax1, "mb_s", "MB/s (log)"), (ax2, "p50_us", "p50 latency, us (log)")):
            width = 0.8 / len(targets)
            for i, t in enumerate(targets):
                ax.bar([j + i * width for j in range(len(keys))], [fio[t][k][field] for k in keys], width, label=t)
            ax.set_xticks([j + 0.4 - width / 2 for j in range(len(keys))], keys, rotation=30, ha="right", fontsize=8)
            ax.set_yscale("log")
            ax.set_ylabel(label)
            ax.legend(fontsize=8)
        ax1.set_title("fio bandwidth")
        ax2.set_title("fio completion latency")
        fig.tight_layout()
        path = os.path.join(out, "bench-fio.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        files.append(path)
    return files


def write_report(R: dict[str, Any], out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "benchmarks.json"), "w") as f:
        json.dump(R, f, indent=1, default=str)
    images = plots(R, out)
    m = R["machine"]
    L = ["# irdma benchmarks", "",
         f"One run of `make bench` (`.venv/bin/python benchmarks/run.py`) on {m['date']}{_at(m.get('commit'))}:"
         f" {m['cpus']} cores,",
         f"Python {m['python']}, kernel {m['kernel']}{' (quick mode: not figures)' if m['quick'] else ''}. "
         f"The run took {R['elapsed_s']:.0f} s."
         + "".join(f" The {what} were measured again on {R[key + '_date']}{_at(R.get(key + '_commit'))}"
                   f" (`benchmarks/run.py --only {key}`)."
                   for key, what in (("rounds", "model rounds"), ("fio", "fio runs"), ("rows", "sparse rows"),
                                     ("snapshots", "snapshots"))
                   if R.get(key + "_date")),
         "Every figure is set against a baseline measured in the same run (the machine is noisy).",
         "Bandwidth in MB/s (10^6 bytes per second); everything on 127.0.0.1.", "",
         "## Targets", "", "| target | ratio | baseline | wanted | met | figures |", "|---|---|---|---|---|---|"]
    for t in targets(R):
        wanted = f"{'<=' if t['lower_is_better'] else '>='} {t['target']:g}"
        L.append(f"| {t['what']} | {t['ratio']:.2f} | {t['baseline']} | {wanted} | {'yes' if t['met'] else '**no**'}"
                 f" | {t['figures']} |")
    if R.get("regression_check"):
        L += ["", *markdown(R["regression_check"])]
    runs, mruns = R.get("tcp_runs", []), R.get("tcp_mac_runs", [])
    each = ("; ".join(", ".join("{:.0f}/{:.0f}".format(r["pull"], r["push"]) for r in rr) + f" {name}"
                      for rr, name in ((runs, "raw"), (mruns, "with the GMAC")) if rr))
    L += ["", "## Bandwidth, 1 GiB, 4 MiB requests, 4 in flight", "",
          "Two ceilings, each the mean of two measurements, before and after irdma's"
          + (f" ({each} MB/s pull/push)" if each else "") + ": raw loopback TCP (4 streams to another"
          " process, 4 MiB blocks), the ceiling of `--security auth`, whose payloads go untagged; and the"
          " *same-work ceiling* of the default `integrity` level: the same streams with a 16-byte GMAC"
          " (AES-256-GCM, `irdma.wire.auth.FrameMac`) per 4 MiB block, computed by the sender and computed"
          " again and compared by the receiver, the work a shard and a client must do for every frame."
          " The integrity-level native figures are set against the second, the `--security auth` ones"
          " (Authentication, below) against the first.",
          "",
          "| path | read / pull | write / push (assign) | push (add) | read ratio to raw TCP | write ratio to raw TCP |"
          " read ratio to same-work | write ratio to same-work |",
          "|---|---|---|---|---|---|---|---|"]
    tcp = R["tcp"]
    mac = R.get("tcp_mac")
    rows = [("loopback TCP, 4 streams (ceiling of --security auth)", tcp["pull"], tcp["push"], None)]
    if mac:
        rows.append(("loopback TCP, 4 streams, GMAC per 4 MiB block (same-work ceiling)", mac["pull"], mac["push"],
                     None))
    rows += [
        ("tmpfs, 4 MiB blocks (ceiling)", R["tmpfs"]["read"], R["tmpfs"]["write"], None),
        ("irdma native client, 4 shards", R["native"]["pull"], R["native"]["push-assign"], R["native"]["push-add"]),
        ("irdma through the mount (direct I/O)", R["mount"]["pull"], R["mount"]["push-assign"], R["mount"]["push-add"]),
    ]
    for name, rd, wr, add in rows:
        same = f" {rd / mac['pull']:.2f} | {wr / mac['push']:.2f} |" if mac else " - | - |"
        L.append(f"| {name} | {rd:.0f} | {wr:.0f} | {'-' if add is None else f'{add:.0f}'} | {rd / tcp['pull']:.2f}"
                 f" | {wr / tcp['push']:.2f} |{same}")
    L += ["", f"A push with `assign` creates its chunks, so it writes fresh shard memory: against the tmpfs write of a"
          f" new file (fresh pages too) it is {R['native']['push-assign'] / R['tmpfs']['write']:.2f}x"
          f" ({R['native']['push-assign']:.0f} vs {R['tmpfs']['write']:.0f} MB/s)."]
    fresh, nat = R.get("tcp_fresh"), R["native"]
    if fresh:
        fr = R.get("tcp_fresh_runs", [])
        L += ["", "The ceiling of that push is the same streams with each stream's bytes received into memory the"
              " receiver never held, block after block (a new file's shared mapping on the filesystem of the shards'"
              " data directories, its blocks allocated first, as a shard's region): raw"
              f" {fresh['raw']:.0f} and with the GMAC {fresh['mac']:.0f} MB/s"
              + (" (runs: " + ", ".join(f"{r['raw']:.0f}/{r['mac']:.0f}" for r in fr) + ")" if fr else "")
              + f", against {tcp['push']:.0f} and {mac['push'] if mac else 0:.0f} into one warm buffer."
              " On this virtual machine the first touch of a page is the bound: the guest hands memory that"
              " stayed free for 2 s back to its host, and each page of it costs a host fault when next"
              " touched (a single memcpy into a new file's mapping runs at about 500 MB/s here, the next"
              " pass over the same pages at 28,000). Each fresh ceiling, and the native push, starts 3 s after"
              " the memory the section before freed, so all meet memory in the same state."
              f" irdma's push (assign) of new chunks is {nat['push-assign'] / fresh['mac']:.2f} of the fresh"
              " same-work ceiling"
              + (f"; the same push again, onto the chunks it made (memory the shards hold), runs at"
                 f" {nat['push-assign-existing']:.0f} MB/s, {nat['push-assign-existing'] / mac['push']:.2f} of the"
                 " warm same-work ceiling." if "push-assign-existing" in nat and mac else ".")]
    r = R["rounds"]
    L += ["", "## Model rounds: ResNet-50's 25.6 M float32 in 320 tensors, 2 workers, 2 servers", "",
          "One round: each worker pushes a gradient for every tensor (update op `add`), then pulls every",
          "tensor. *Unified buffer* (SoftMemoryBox II; what `irdma.train.keras.ShardOptimizer` moves): all 320",
          "tensors at their offsets in one 102 MB file of 4 MiB chunks, kept open; a round is one `pwrite` of",
          "the gradients and one `preadv` of the weights (natively one `write_from` and one `read_into`).",
          "*A file per tensor*: 320 files, each opened, written and closed, then read. The unified",
          "buffer, the per-tensor native client, ParameterServerStrategy and Redis ran alternately twice;",
          "the table gives the means"
          + (" (runs: " + "; ".join(f"{k} " + ", ".join(f"{x * 1e3:.0f}" for x in v) + " ms"
                                    for k, v in r["runs"].items()) + ")." if "runs" in r else "."), "",
          "| system | ms per round | ratio to ParameterServerStrategy (x faster) |", "|---|---|---|"]
    for name, label in (("irdma-native-unified", "irdma, native client, unified buffer"),
                        ("irdma-mount-unified", "irdma, through the mount, unified buffer"),
                        ("irdma-native", "irdma, native client, a file per tensor"),
                        ("irdma-mount", "irdma, through the mount, a file per tensor"),
                        ("tf-ps", "TensorFlow ParameterServerStrategy (gRPC, in-process cluster)"),
                        ("redis", "Redis 7 (redis-py, WATCH/MULTI read-modify-write)")):
        if name in r:
            L.append(f"| {label} | {r[name] * 1e3:.0f} | {r['tf-ps'] / r[name]:.2f} |")
    L += ["", "## How cost grows (native client, MB/s)", ""]
    for key, title, fmt in (("by_shards", "shards (256 MiB file)", str),
                            ("by_chunk", "chunk size (4 shards, 256 MiB file)", lambda k: fmt_size(int(k))),
                            ("by_size", "file size (4 shards, 4 MiB chunks)", lambda k: fmt_size(int(k))),
                            ("by_workers", "concurrent client processes (aggregate, 4 shards)", str)):
        L += [f"| {title} | pull | push (assign) |", "|---|---|---|"]
        first = None
        for k, v in R[key].items():
            first = first or v
            L.append(f"| {fmt(k)} | {v['pull']:.0f} ({v['pull'] / first['pull']:.2f}x) |"
                     f" {v['push-assign']:.0f} ({v['push-assign'] / first['push-assign']:.2f}x) |")
        L.append("")
    rep = R.get("replication")
    if rep:
        L += ["## Replication (4 shards, native client, MB/s)", "",
              "| test | 1 replica | 2 replicas | ratio | wanted |", "|---|---|---|---|---|"]
        for test, want in REPLICATION_WANTED:
            a, b = rep["r1"][test], rep["r2"][test]
            L.append(f"| {test} | {a:.0f} | {b:.0f} | {b / a:.2f} | >= {want} |")
        L += ["", f"Push (assign) then flush, 2 replicas: durable (`--durability fsync`)"
              f" {rep['durability-fsync']:.0f} MB/s against {rep['durability-memory']:.0f} MB/s in memory"
              f" ({rep['durability-fsync'] / rep['durability-memory']:.2f}x).",
              f"Resync of a restarted shard that missed {rep['resync']['bytes'] >> 20} MiB:"
              f" {rep['resync']['seconds']:.2f} s, {rep['resync']['mb_s']:.0f} MB/s."]
        if "drain" in rep:
            L.append(f"Drain of a shard holding {rep['drain']['bytes'] >> 20} MiB (3 shards, 2 replicas, under no load):"
                     f" {rep['drain']['seconds']:.2f} s, {rep['drain']['mb_s']:.0f} MB/s.")
        L.append("")
    au = R.get("authentication")
    if au:
        L += ["## Authentication (4 shards, native client, one replica, MB/s)", "",
              "Every frame tagged (GMAC, AES-256-GCM) under a per-connection key (SECURITY.md) against shards run",
              "with `--no-auth`, in the same run; `--security auth` tags headers and control fields, not tensor"
              " payloads (SECURITY.md):", "",
              "| test | --no-auth | authenticated (integrity) | ratio | wanted | --security auth | ratio |",
              "|---|---|---|---|---|---|---|"]
        for test in ("pull", "push-assign", "push-add"):
            a, b = au["off"][test], au["on"][test]
            c = au.get("auth", {}).get(test)
            tail = f" {c:.0f} | {c / a:.2f} |" if c else " - | - |"
            L.append(f"| {test} | {a:.0f} | {b:.0f} | {b / a:.2f} | >= {AUTHENTICATION_WANTED} |{tail}")
        L.append("")
    fio = R.get("fio")
    if fio:
        where = list(fio)
        L += ["## fio: tmpfs, the FUSE ceiling and the mount", "",
              "`benchmarks/fio.py`: fio 3 (psync engine, O_DIRECT through the FUSE mounts; tmpfs takes no O_DIRECT)"
              " on tmpfs, a minimal",
              "pyfuse3 + trio passthrough of tmpfs (`benchmarks/passthrough.py`: the cost of FUSE and pyfuse3 alone)"
              " and irdma's mount",
              "(4 shards, one replica). MB/s, IOPS, completion latency p50/p99 in microseconds; the last column is"
              " the mount over the passthrough"
              + (f" (measured again on {R['fio_date']}, `benchmarks/run.py --only fio`)." if R.get("fio_date") else "."),
              "", "| job | " + " | ".join(where) + " | mount / passthrough |", "|---|" + "---|" * (len(where) + 1)]
        for k in fio[where[0]]:
            cells = [f"{fio[t][k]['mb_s']:.1f} MB/s, {fio[t][k]['iops']:.0f} IOPS, {fio[t][k]['p50_us']:.0f}/"
                     f"{fio[t][k]['p99_us']:.0f} us" for t in where]
            pt, mn = fio["pyfuse3 passthrough of tmpfs"][k], fio["irdma mount"][k]
            L.append(f"| {k} | " + " | ".join(cells) + f" | {mn['iops'] / pt['iops']:.2f} |")
        L.append("")
    rw = R.get("rows")
    if rw:
        mb = rw["picked"] * rw["row_bytes"] / 1e6
        L += ["## Sparse rows (ps-lite's sparse pull and push)", "",
              f"`benchmarks/rows.py`: {rw['picked']:,} random rows of {rw['row_bytes'] // 4} float32 ({mb:.0f} MB) of a"
              f" {rw['rows']:,}-row file over 4 shards (one replica), median of {rw['repeats']} alternating runs"
              + (f" (measured again on {R['rows_date']}, `benchmarks/run.py --only rows`)" if R.get("rows_date") else "")
              + ".", "",
              "| how | seconds | MB/s |", "|---|---|---|"]
        for key, what in (("contig-pull", "contiguous pull of the same bytes (`read_into`)"),
                          ("rows-pull", "`pull_rows` (one GATHER per shard)"),
                          ("contig-add", "contiguous push, add (`write_from`)"),
                          ("rows-add", "`push_rows`, add (one SCATTER per shard)"),
                          ("mount-pread-x1", "through the mount: one `pread` per row, 1 thread"),
                          ("mount-pread-x16", "through the mount: one `pread` per row, 16 threads")):
            if key in rw:
                L.append(f"| {what} | {rw[key]['seconds']:.4f} | {rw[key]['mb_s']:.0f} |")
        if "rows-pull-batches-of-1000" in rw:
            L.append(f"| `pull_rows` in 10 calls of 1,000 rows | {rw['rows-pull-batches-of-1000']['seconds']:.4f} |"
                     f" {mb / rw['rows-pull-batches-of-1000']['seconds']:.0f} |")
        L.append("")
        z = rw.get("zipf")
        if z:
            L += [f"Zipf ids (issue 40): {rw['picked']:,} ids drawn with p(rank r) ~ r^-{z['s']} (the popular rows spread"
                  f" over the table), {z['distinct']:.0f} of them distinct (median), against the contiguous pull and push"
                  " of the distinct rows' bytes (what crosses the wire either way).", "",
                  "| how | seconds | ratio |", "|---|---|---|",
                  f"| contiguous pull of the distinct rows' bytes | {z['contig-pull']['seconds']:.4f} | |",
                  f"| `pull_rows` of the {rw['picked']:,} ids | {z['rows-pull']['seconds']:.4f} | {z['pull_ratio']:.2f} |",
                  f"| contiguous push (add) of the distinct rows' bytes | {z['contig-add']['seconds']:.4f} | |",
                  f"| `push_rows` (add) of the {rw['picked']:,} ids, duplicates summed | {z['rows-add']['seconds']:.4f} |"
                  f" {z['add_ratio']:.2f} |", ""]
    sn = R.get("snapshots")
    if sn:
        L += _snapshots_section(sn, R.get("snapshots_date"))
    L += ["## Memory", "", "| shard holding | shard RSS |", "|---|---|"]
    for k, v in R["shard_rss"].items():
        L.append(f"| {fmt_size(int(k)) if int(k) else '0'} | {v / 1e6:.0f} MB |")
    L += ["", f"FUSE mount process, peak RSS while streaming 1 GiB through it: {R['fuse_rss_peak'] / 1e6:.0f} MB.", "",
          "## Checkpoints: tf.train.CheckpointManager, 100 MB model, median of 3 alternating runs", "",
          "| where | save | restore |", "|---|---|---|",
          f"| tmpfs | {R['ckpt']['tmpfs_save_s']:.2f} s | {R['ckpt']['tmpfs_restore_s']:.2f} s |"]
    if "passthrough_save_s" in R["ckpt"]:  # the FUSE ceiling (runs from before it have none)
        L.append(f"| pyfuse3 passthrough of tmpfs | {R['ckpt']['passthrough_save_s']:.2f} s |"
                 f" {R['ckpt']['passthrough_restore_s']:.2f} s |")
    L += [f"| irdma mount | {R['ckpt']['mount_save_s']:.2f} s | {R['ckpt']['mount_restore_s']:.2f} s |", "",
          "A restore right after its save reads through FUSE on the passthrough as on the mount: the"
          " kernel drops the file's pages at the first getattr after the writes (auto_inval_data on a"
          " changed mtime), so the passthrough's restore is the least a pyfuse3 mount's can be"
          " (docs/internals.md).", "",
          "## Plots", ""]
    L += [f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in images]
    L += ["", "## How to reproduce", "", "```sh", "make bench      # installs redis-server and matplotlib, then runs benchmarks/run.py",
          "```", "", "Notes: a push with `assign` creates its chunks, so it writes into fresh memory of the shard; on",
          "this machine (a VM) populating fresh pages is itself slow, as the tmpfs write of a new 1 GiB file",
          "shows, while a push with `add` lands in chunks that exist. The ceilings use the same number of",
          "streams and the same 4 MiB buffers as irdma. Peers are real installations: TensorFlow's",
          "ParameterServerStrategy with `tf.distribute.Server` gRPC servers in one process, and Debian's",
          "redis-server driven by redis-py.", ""]
    with open(os.path.join(out, "benchmarks.md"), "w") as f:
        f.write("\n".join(L))
