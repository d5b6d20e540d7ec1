"""Where a local-tier restore spends its time: the restore of ``bench.gpu`` run a few
times while a sampler thread records, every millisecond, the innermost ckptd frame
of every thread (native work such as blake3, memcpy or a CUDA copy shows as the
Python line that called it). Prints the top lines by samples.

    python -m bench.profile_restore --size 2G              # on cuda when there is one
    python -m bench.profile_restore --size 512M --device cpu
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import threading
import time

from bench.common import (
    make_state,
    parse_size,
    quiet_own_sibling_pools,
    scratch_dir,
    tensors_of,
)
from bench.gpu import on_device, sync


def where(frame) -> str:  # type: ignore[no-untyped-def]
    """The innermost frame in ckptd's own code (client/, ckptd/, server/)."""
    f = frame
    while f is not None:
        name = f.f_code.co_filename
        if any(p in name for p in ("/client/", "/ckptd/", "/server/")):
            return f"{os.path.basename(name)}:{f.f_lineno} {f.f_code.co_name}"
        f = f.f_back
    return f"(other) {os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}"


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="2G", help="state size (default 2G)")
    parser.add_argument("--device", default=None,
                        help="where the state lives: cuda, cuda:N or cpu (default cuda when "
                             "there is a CUDA device, else cpu)")
    parser.add_argument("--rounds", type=int, default=3, help="restores sampled (default 3)")
    parser.add_argument("--atomic", type=int, choices=(0, 1), default=1,
                        help="1: atomic restores (default), 0: atomic=False")
    args = parser.parse_args()
    quiet_own_sibling_pools()
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("bench.profile_restore: no CUDA device here; nothing measured (--device cpu "
                 "profiles a restore into CPU tensors)")
    from ckptd.client import Checkpointer

    counts: collections.Counter[str] = collections.Counter()
    active = threading.Event()
    stop = threading.Event()
    me = threading.get_ident()

    def sampler() -> None:
        while not stop.is_set():
            if active.is_set():
                for tid, frame in sys._current_frames().items():
                    if tid != me and tid != threading.get_ident():
                        inner = frame.f_code.co_name
                        if inner in ("_worker", "wait", "select", "get", "sleep", "run_forever",
                                     "_run_once") or inner.startswith("_bootstrap"):
                            continue  # an idle thread: pool worker, event loop, waits
                        counts[where(frame)] += 1
                    elif tid == me:
                        counts["[main] " + where(frame)] += 1
            time.sleep(0.001)

    thread = threading.Thread(target=sampler, daemon=True)
    thread.start()
    with scratch_dir(None, "ckptd-prof-") as scratch:
        url = f"file://{scratch / 'store'}"
        state = on_device(make_state(parse_size(args.size)), args.device)
        with Checkpointer(url, "prof", chunk_size=4 << 20, serve_peers=False) as saver:
            saver.save(1, state).wait(timeout=1800)
            times = []
            for _ in range(args.rounds):
                target = on_device({k: v for k, v in state.items()}, args.device)
                for t in tensors_of(target):
                    t.zero_()
                with Checkpointer(url, "prof", serve_peers=False) as reader:
                    sync(args.device)
                    active.set()
                    t0 = time.perf_counter()
                    reader.restore(target, step=1, tiers=("local",), atomic=bool(args.atomic))
                    sync(args.device)
                    times.append(time.perf_counter() - t0)
                    active.clear()
                del target
    stop.set()
    thread.join()
    print(f"restore seconds (on {args.device}):", ", ".join(f"{t:.3f}" for t in times))
    total = sum(counts.values())
    for w, n in counts.most_common(30):
        print(f"{n:6d} {100 * n / total:5.1f}%  {w}")


if __name__ == "__main__":
    main()
