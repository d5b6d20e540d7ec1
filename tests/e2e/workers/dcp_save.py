"""dcp.save (step 1) and dcp.async_save (step 2) through ckptd's Writer.

argv: out url job."""

from __future__ import annotations

import sys

import torch.distributed.checkpoint as dcp
from common import finish, init
from dcp_state import SAVE, build
from torch.distributed.device_mesh import init_device_mesh

from ckptd.client.dcp import Writer, checkpoint_id


def main() -> None:
    rank, world, out = init()
    url, job = sys.argv[2], sys.argv[3]
    mesh = init_device_mesh("cpu", (world,))

    writer = Writer(url, job, 1, chunk_size=4096, timeout=60)
    dcp.save(build(mesh, SAVE, 1, zero=False), storage_writer=writer)
    first = writer.last_write

    # async_save stages a CPU copy, then runs the whole save in a thread.
    async_writer = Writer(url, job, chunk_size=4096, timeout=60)
    future = dcp.async_save(build(mesh, SAVE, 2, zero=False), storage_writer=async_writer,
                            checkpoint_id=checkpoint_id(url, job, 2))
    future.result(timeout=120)
    second = async_writer.last_write
    assert first is not None and second is not None
    finish(out, rank, {
        "bytes_sent": [first.bytes_sent, second.bytes_sent],
        "bytes_total": [first.bytes_total, second.bytes_total],
        "tensors": [first.tensors, second.tensors],
        "values": [first.values, second.values],
        "rank_in_manifest": first.rank,
        "world_size": first.world_size,
    })


if __name__ == "__main__":
    main()
