"""Space accounting at a million tensor entries (issue 20 item 6).

    python -m bench.census                 # 2 jobs x 2 steps x 2 ranks x 125,000 tensors
    python -m bench.census --tensors 50000 # a smaller store
    python -m bench.census --commit-tensors 400000   # and a large commit meanwhile

Two real servers start together, one over an empty store (the peer: the same
server with nothing to count), one over a store of a million tensor entries
written straight into it (``ckptd.testing.big_store``); 256 KiB saves alternate
between them while another process polls both ``/healthz`` and ``GET /v1/space``
is asked after every save, until the large server's census has counted the
store from scratch. Prints each figure for both and the ratio. Targets: saves
and /healthz within 2x of the empty store's, GET /v1/space under 1 s. The
machine is shared: the output says how many CPUs it saw and its load."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from bench.common import Table, fmt_s, fmt_x, human_bytes, ratio
from tests.lifecycle.census_scale import measure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=int, default=125_000, help="per rank manifest")
    parser.add_argument("--rounds", type=int, default=20, help="saves per server, at least")
    parser.add_argument("--commit-tensors", type=int, default=0,
                        help="first commit a step of this many tensors on each server, twice, "
                        "while the census counts (the issue's 400,000)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ckptd-census-") as tmp, \
            tempfile.TemporaryDirectory(prefix="ckptd-census-", dir="/dev/shm") as shm:
        run = measure(Path(tmp), Path(shm), tensors=args.tensors, min_rounds=args.rounds,
                      commit_tensors=args.commit_tensors)
    empty, full = run.empty.row(), run.full.row()
    table = Table(f"Census: {run.big.entries:,} tensor entries beside an empty store "
                  f"({os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f})",
                  ["figure", "empty store", f"{run.big.entries:,} entries", "ratio"])
    for key, label in (("save_median", "256 KiB save, median"), ("save_p90", "save, p90"),
                       ("health_median", "/healthz, median"), ("health_p90", "/healthz, p90"),
                       ("health_worst", "/healthz, worst"),
                       ("space_worst", "GET /v1/space, worst"),
                       *([("commit_median", f"commit of {args.commit_tensors:,} tensors, "
                           "median")] if args.commit_tensors else [])):
        table.add(label, fmt_s(empty[key]), fmt_s(full[key]), fmt_x(ratio(full[key], empty[key])))
    table.add("server peak RSS (VmHWM)", human_bytes(run.empty.peak_rss),
              human_bytes(run.full.peak_rss), fmt_x(ratio(run.full.peak_rss, run.empty.peak_rss)))
    table.add("census worker peak RSS", human_bytes(run.empty.worker_peak_rss),
              human_bytes(run.full.worker_peak_rss),
              fmt_x(ratio(run.full.worker_peak_rss, run.empty.worker_peak_rss)))
    table.note(f"census of the large store from a cold start: {run.census_s:.1f} s (worker "
               f"at most half a core, reniced), {len(run.full.saves)} saves each; store "
               f"written in {run.fill_s:.1f} s; complete={run.final.get('complete')}")
    table.print()
    print(table.markdown())


if __name__ == "__main__":
    main()
