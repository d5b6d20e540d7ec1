"""What the soak (bench/soak.py, issue 20 item 7) found growing in a server that
saves every few seconds: the parsed-manifest cache was capped by tensor entries
alone, so a server kept every small manifest of every step it ever took (those
retention forgot included): +45 MiB an hour for 4 ranks saving every 4 s."""

from __future__ import annotations

from ckptd.documents import MANIFEST_CACHE_ENTRIES, MANIFEST_CACHE_MANIFESTS, ParsedManifests
from ckptd.format import manifest_key
from ckptd.repository import Repository
from ckptd.store import MemoryStore
from ckptd.testing.manifests import demo_step


def test_the_parsed_manifest_cache_keeps_a_bounded_number_of_small_manifests() -> None:
    cache = ParsedManifests(MANIFEST_CACHE_ENTRIES)
    steps = MANIFEST_CACHE_MANIFESTS // 2 + 10
    for step in range(steps):
        for manifest, _ in demo_step("j", step, 2):
            cache.put(manifest_key("j", step, manifest.rank), manifest.canonical(), manifest)
    assert len(cache._held) == MANIFEST_CACHE_MANIFESTS
    assert cache._entries == 3 * MANIFEST_CACHE_MANIFESTS  # (three entries each)
    # the newest stay: a commit and the plans of its step read them again
    newest = demo_step("j", steps - 1, 2)[1][0]
    data = newest.canonical()
    assert cache.get(manifest_key("j", steps - 1, 1), data) is not None


async def test_a_repository_keeps_no_more_manifests_than_its_cap() -> None:
    repo = Repository(MemoryStore())
    assert repo._manifests.max_manifests == MANIFEST_CACHE_MANIFESTS <= 1024
    assert repo._manifests.max_entries == MANIFEST_CACHE_ENTRIES
