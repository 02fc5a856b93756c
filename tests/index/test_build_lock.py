"""Two builds of one index directory: the second fails at once, the first is untouched."""

import pytest

from openbook.index import build_index, open_index
from openbook.index.spec import BuildOptions, IndexSpec
from openbook.index.stages import build_lock
from openbook_testkit.index import write_facts


def test_concurrent_build_of_the_same_index_is_refused(tmp_path):
    source = write_facts(tmp_path / "facts.jsonl")
    out = tmp_path / "indexes" / "facts"
    # build_lock stands for another process's build, as far as build_index can tell.
    with build_lock(out), pytest.raises(RuntimeError, match="'facts' is being built by pid"):
        build_index(
            [source], out, IndexSpec(name="facts", index_type="bm25"), BuildOptions(progress=False)
        )
    assert not out.exists()
    build_index(
        [source], out, IndexSpec(name="facts", index_type="bm25"), BuildOptions(progress=False)
    )
    assert open_index(out).manifest.count == 30
