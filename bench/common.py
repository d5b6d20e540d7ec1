"""What every benchmark shares: a synthetic training state, in-place byte edits that
make a state new to a content-addressed store, medians over alternating rounds,
tables with ratio columns, a real ``ckptd serve`` process, and /proc memory
figures."""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

# Edits that make a state new to the store touch one byte in every STRIDE bytes:
# every chunk (4 KiB or larger, at fixed offsets) then changes, and the edit costs
# a strided pass instead of a full one.
STRIDE = 4096
ROUND_OFFSET = 0  # the byte a round's edit touches: the state every system saves
WARMUP_OFFSET = 1  # the byte a warm-up's edit touches: a state saved only to warm up


# ---------------------------------------------------------------- sizes and text


def parse_size(text: str) -> int:
    """``256M``, ``1G``, ``1.5GiB``, ``4096`` -> bytes (binary units)."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    units = {"K": KiB, "M": MiB, "G": GiB, "T": 1 << 40}
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def human_bytes(n: float | None) -> str:
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "-"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def size_label(n: int) -> str:
    if n % GiB == 0:
        return f"{n // GiB} GiB"
    if n % MiB == 0:
        return f"{n // MiB} MiB"
    return human_bytes(n)


def fmt_s(seconds: float | None) -> str:
    if seconds is None or math.isnan(seconds):
        return "-"
    if seconds < 0.01:
        return f"{seconds * 1000:.2f} ms"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    return f"{seconds:.2f} s"


def fmt_x(ratio: float | None) -> str:
    if ratio is None or math.isnan(ratio) or math.isinf(ratio):
        return "-"
    if ratio < 0.01:
        return f"{ratio:.4f}x"
    if ratio < 10:
        return f"{ratio:.2f}x"
    return f"{ratio:.0f}x"


def fmt_gbps(nbytes: int, seconds: float | None) -> str:
    if not seconds or math.isnan(seconds):
        return "-"
    return f"{nbytes / seconds / 1e9:.2f}"


def ratio(a: float | None, b: float | None) -> float:
    if a is None or b is None or b == 0 or math.isnan(a) or math.isnan(b):
        return float("nan")
    return a / b


# ---------------------------------------------------------------- the state


def _layer_shapes(hidden: int) -> list[tuple[str, tuple[int, ...]]]:
    """One pre-norm transformer block: attention (fused qkv), MLP (4x), two norms."""
    return [
        ("attn_norm.weight", (hidden,)),
        ("attn.qkv.weight", (3 * hidden, hidden)),
        ("attn.qkv.bias", (3 * hidden,)),
        ("attn.out.weight", (hidden, hidden)),
        ("mlp_norm.weight", (hidden,)),
        ("mlp.up.weight", (4 * hidden, hidden)),
        ("mlp.down.weight", (hidden, 4 * hidden)),
    ]


# bf16 weights, fp32 AdamW moments: 2 + 4 + 4 bytes per parameter.
BYTES_PER_PARAM = 10


def state_plan(
    nbytes: int, hidden: int = 1024, vocab: int = 8192
) -> list[tuple[str, tuple[int, ...]]]:
    """Parameter names and shapes whose weights and optimizer moments add up to
    ``nbytes`` (to within one row): an embedding, as many blocks as fit, and an
    output head that takes the remainder."""
    params = nbytes // BYTES_PER_PARAM
    plan: list[tuple[str, tuple[int, ...]]] = []
    embed = min(vocab, max(1, params // (4 * hidden))) * hidden
    plan.append(("embed.weight", (embed // hidden, hidden)))
    used = embed
    block = sum(math.prod(s) for _, s in _layer_shapes(hidden))
    i = 0
    while used + block + hidden <= params:
        plan += [(f"layers.{i}.{n}", s) for n, s in _layer_shapes(hidden)]
        used += block
        i += 1
    rows = (params - used) // hidden
    if rows > 0:
        plan.append(("head.weight", (rows, hidden)))
    return plan


def make_state(nbytes: int, seed: int = 0, hidden: int = 1024) -> dict[str, Any]:
    """A training state of about ``nbytes``: ``model`` (bf16 weights), ``optim``
    (AdamW ``exp_avg`` / ``exp_avg_sq`` in fp32, keyed by parameter name as DCP's
    ``get_state_dict`` does, and its param group), and the step. Random, so no
    two chunks are alike; the same ``seed`` and size give the same bytes, and no
    chunk of one size's state is in another's (the seed is mixed with the size)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + nbytes)
    model: dict[str, torch.Tensor] = {}
    moments: dict[str, dict[str, Any]] = {}
    for name, shape in state_plan(nbytes, hidden):
        # Made in place: no temporaries that the allocator keeps and later hands to
        # a staging buffer, which would hide that buffer from the memory figures.
        model[name] = torch.randn(shape, generator=gen, dtype=torch.bfloat16)
        exp_avg = torch.randn(shape, generator=gen).mul_(1e-3)
        exp_avg_sq = torch.rand(shape, generator=gen).mul_(1e-6)
        moments[name] = {"step": 1000.0, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    group = {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
             "params": list(model)}
    release_free_memory()
    return {"model": model, "optim": {"state": moments, "param_groups": [group]}, "step": 1000}


def release_free_memory() -> None:
    """Collect garbage and give the allocator's free pages back to the kernel
    (glibc ``malloc_trim``), so that RSS counts only live memory."""
    gc.collect()
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)


def tensors_of(state: Any) -> list[torch.Tensor]:
    """Every tensor leaf of a nested state, in a fixed order."""
    out: list[torch.Tensor] = []

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, dict):
            for k in x:
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(state)
    return out


def state_nbytes(state: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(state))


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """The tensor's storage as a flat uint8 tensor (a view: edits land in ``t``)."""
    return t.reshape(-1).view(torch.uint8)


def edit_strided(state: Any, offset: int, delta: int) -> None:
    """Add ``delta`` (mod 256) to byte ``offset`` of every ``STRIDE`` bytes of every
    tensor: every chunk changes; undo with ``-delta``."""
    for t in tensors_of(state):
        b = byte_view(t)
        if b.numel() > offset:
            b[offset::STRIDE] += delta


@dataclass(frozen=True, slots=True)
class Region:
    tensor: int  # index into tensors_of(state)
    start: int  # byte offset
    end: int


def edit_regions(state: Any, regions: Sequence[Region], delta: int = 1) -> int:
    """Add ``delta`` to every byte of each region (so each of them changes); the bytes changed."""
    ts = tensors_of(state)
    changed = 0
    for r in regions:
        byte_view(ts[r.tensor])[r.start : r.end] += delta
        changed += r.end - r.start
    return changed


def top_layers_regions(state: Any, fraction: float) -> list[Region]:
    """``fraction`` of the state's tensor bytes, as whole tensors taken from the top of
    the network down (a parameter and its two moments together): what changes when
    the lower layers are frozen. The last one is cut to hit the fraction exactly."""
    ts = tensors_of(state)
    model = state["model"]
    moments = state["optim"]["state"]
    index = {id(t): i for i, t in enumerate(ts)}
    budget = int(fraction * state_nbytes(state))
    regions: list[Region] = []
    for name in reversed(list(model)):
        for t in (model[name], moments[name]["exp_avg"], moments[name]["exp_avg_sq"]):
            n = t.numel() * t.element_size()
            take = min(n, budget)
            if take > 0:
                regions.append(Region(index[id(t)], 0, take))
                budget -= take
        if budget <= 0:
            break
    return regions


def prefix_regions(state: Any, fraction: float) -> list[Region]:
    """The first ``fraction`` of every tensor's bytes: 10% of each parameter changed,
    wherever the chunk boundaries fall."""
    regions = []
    for i, t in enumerate(tensors_of(state)):
        n = t.numel() * t.element_size()
        take = int(n * fraction)
        if take:
            regions.append(Region(i, 0, take))
    return regions


def chunks_touched(state: Any, regions: Sequence[Region], chunk_size: int) -> int:
    """Bytes of the fixed-offset chunks that the regions overlap: what an ideal
    content-addressed incremental save sends."""
    ts = tensors_of(state)
    total = 0
    for r in regions:
        n = ts[r.tensor].numel() * ts[r.tensor].element_size()
        first = r.start // chunk_size
        last = (r.end - 1) // chunk_size
        for c in range(first, last + 1):
            total += min((c + 1) * chunk_size, n) - c * chunk_size
    return total


class CopyFloor:
    """One plain copy of the state into preallocated, already touched tensors: the
    least any staging can cost."""

    def __init__(self, state: Any) -> None:
        self._src = tensors_of(state)
        self._dst = [torch.empty_like(t) for t in self._src]
        self.copy()  # touch every page once

    def copy(self) -> None:
        for d, s in zip(self._dst, self._src, strict=True):
            d.copy_(s)

    def close(self) -> None:
        self._dst = []


# ---------------------------------------------------------------- timing


@dataclass
class Samples:
    """Per system, per metric: the value of every timed round."""

    values: dict[str, dict[str, list[float]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(list))
    )

    def add(self, system: str, metric: str, value: float) -> None:
        self.values[system][metric].append(value)

    def median(self, system: str, metric: str) -> float:
        v = self.values.get(system, {}).get(metric)
        return statistics.median(v) if v else float("nan")

    def spread(self, system: str, metric: str) -> str:
        v = self.values.get(system, {}).get(metric)
        if not v:
            return "-"
        return f"{fmt_s(min(v))} - {fmt_s(max(v))}"

    def count(self, system: str, metric: str) -> int:
        return len(self.values.get(system, {}).get(metric, []))


def quiesce() -> None:
    """Write back other dirty pages and collect garbage, so that a timed run pays
    only for its own bytes."""
    gc.collect()
    os.sync()


def rotated(items: Sequence[Any], k: int) -> list[Any]:
    """``items`` started at position ``k``: each round runs the systems in a new order."""
    k %= max(1, len(items))
    return list(items[k:]) + list(items[:k])


# ---------------------------------------------------------------- tables


class Table:
    """A table printed with rich on a terminal and kept as markdown for RESULTS.md."""

    def __init__(self, title: str, columns: Sequence[str]) -> None:
        self.title = title
        self.columns = list(columns)
        self.rows: list[list[str]] = []
        self.notes: list[str] = []

    def add(self, *cells: Any) -> None:
        self.rows.append([str(c) for c in cells])

    def note(self, text: str) -> None:
        self.notes.append(text)

    def print(self) -> None:
        from rich.console import Console
        from rich.table import Table as RichTable

        t = RichTable(title=self.title, title_justify="left")
        for i, c in enumerate(self.columns):
            t.add_column(c, justify="left" if i == 0 else "right")
        for r in self.rows:
            t.add_row(*r)
        console = Console(width=200)
        console.print(t)
        for n in self.notes:
            console.print(f"  {n}", highlight=False)

    def markdown(self) -> str:
        lines = [f"**{self.title}**", ""]
        lines.append("| " + " | ".join(self.columns) + " |")
        lines.append("| " + " | ".join(["---"] + ["---:"] * (len(self.columns) - 1)) + " |")
        for r in self.rows:
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in r) + " |")
        for n in self.notes:
            lines += ["", n]
        return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- processes and memory


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """The memory lines of /proc/<pid>/status, in bytes (VmRSS, VmHWM, RssAnon,
    RssFile, RssShmem)."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(rest.split()[0]) * KiB
    return out


def dir_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes of the files under ``path`` (apparent sizes, as stored)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(os.path.join(root, f)).st_size
    return total


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A real ``python -m ckptd serve`` process over a local directory store."""

    def __init__(self, store: Path, log: Path) -> None:
        self.store = store
        self.log = log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.baseline: dict[str, int] = {}

    def __enter__(self) -> Server:
        import httpx

        self.store.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ckptd", "serve", "--store", str(self.store),
             "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=open(self.log, "ab"),  # noqa: SIM115 - the child owns it
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"ckptd serve exited with {self.proc.returncode}; see {self.log}"
                )
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    self.baseline = proc_status(self.proc.pid)
                    return self
            except httpx.HTTPError:
                time.sleep(0.1)
        self.proc.kill()
        raise RuntimeError(f"ckptd serve did not answer /healthz in 60 s; see {self.log}")

    def status(self) -> dict[str, int]:
        assert self.proc is not None
        return proc_status(self.proc.pid)

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None:  # the scratch dir goes away: show what the server said
            with contextlib.suppress(OSError):
                tail = self.log.read_text(errors="replace").splitlines()[-40:]
                print(f"--- last lines of {self.log}:", *tail, sep="\n", file=sys.stderr)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class _OwnSiblingPools(logging.Filter):
    """Drops the staging pool's warning that another pool of this same process holds
    the rank's directory: a restore bench keeps its saver's pool open beside its
    readers on purpose (the local tier it restores from). A pool held by another
    process is still said."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "another pool of this process" not in record.getMessage()


def quiet_own_sibling_pools() -> None:
    """Keeps the bench's deliberate second pools out of its output (see above)."""
    log = logging.getLogger("ckptd.client.staging.pool")
    if not any(isinstance(f, _OwnSiblingPools) for f in log.filters):
        log.addFilter(_OwnSiblingPools())


@contextlib.contextmanager
def scratch_dir(parent: str | None, prefix: str = "ckptd-bench-") -> Iterator[Path]:
    """A directory for everything a run writes, removed afterwards."""
    d = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def machine(scratch: Path) -> list[tuple[str, str]]:
    """What the figures were measured on."""
    cpu = "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = 0
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal"):
                mem = int(line.split()[1]) * KiB
    dev = "?"
    with contextlib.suppress(Exception):
        dev = subprocess.run(["df", "--output=source,fstype", str(scratch)], capture_output=True,
                             text=True, check=True).stdout.splitlines()[1].strip()
    gpu = "none"
    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
    return [
        ("date", time.strftime("%Y-%m-%d %H:%M %Z")),
        ("cpu", f"{os.cpu_count()} cores, {cpu}"),
        ("memory", human_bytes(mem)),
        ("gpu", gpu),
        ("scratch dir", f"{scratch} on {dev}"),
        ("kernel", platform.release()),
        ("python / torch", f"{platform.python_version()} / {torch.__version__}"),
        ("torch threads", str(torch.get_num_threads())),
        ("load average at start", " ".join(f"{x:.2f}" for x in os.getloadavg())),
    ]


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out
