"""An export's windows span at most a window of the file, also where the chunks
written straight from their files left gaps between the pieces still to fill
(client/integrations/safetensors/export.py): a window's buffer is its span."""

from __future__ import annotations

from ckptd.client.integrations.safetensors.export import _Chunk, _windows


def test_windows_group_by_span_not_by_the_bytes_they_hold() -> None:
    mib = 1 << 20
    # Chunks of 4 MiB at 0, 4, then a gap (written from files), 60, 64, 200 MiB.
    pieces = [_Chunk(f"c{i}", "t", at * mib, 4 * mib) for i, at in enumerate((0, 4, 60, 64,
                                                                               200))]
    groups = _windows(pieces, 64 * mib)
    assert [[p.cid for p in g] for g in groups] == [["c0", "c1", "c2"], ["c3"], ["c4"]]
    for g in groups:
        assert g[-1].at + g[-1].size - g[0].at <= 64 * mib
    # Contiguous pieces: as many per window as fit.
    run = [_Chunk(f"r{i}", "t", i * 4 * mib, 4 * mib) for i in range(40)]
    assert [len(g) for g in _windows(run, 64 * mib)] == [16, 16, 8]
