"""A loaded index maps ``vectors.npy`` for random reads (``advise_random_reads``): re-ranking
reads scattered rows, and without the advice every page fault pulls the disk's whole
read-ahead window (8 MB here), which at 21M vectors is gigabytes per query."""

from __future__ import annotations

from pathlib import Path

from bench.index.scale_build import ScaleConfig, ScaleRun, build
from openbook.index.loaded import open_index


def _vm_flags_of(path: Path) -> str:
    """The VmFlags of this process's mapping of ``path`` (Linux /proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.endswith(str(path)):
            for following in lines[i + 1 :]:
                if following.startswith("VmFlags:"):
                    return following
    raise AssertionError(f"{path} is not mapped")


def test_vectors_are_mapped_for_random_reads(tmp_path):
    config = ScaleConfig(passages=3000, shards=1, dim=16, pq_m=4, index_type="flat", queries=4)
    shard = build(ScaleRun(tmp_path / "run", config), progress=False).shard_dirs[0]
    with open_index(shard) as index:
        flags = _vm_flags_of((shard / "vectors.npy").resolve()).split()
        assert "rr" in flags  # MADV_RANDOM
        assert len(index.get_vectors([0, 2999])) == 2
