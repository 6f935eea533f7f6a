from __future__ import annotations

import json

import numpy as np

from trellis.data.convert import from_arrays
from trellis.data.info import format_info, human_bytes, store_info


def test_info_counts_hygiene_and_sizes(tmp_path):
    # 0->1 twice (a duplicate), 2->2 (a self loop), 1->0; node 3 isolated
    path = from_arrays([0, 0, 2, 1], [1, 1, 2, 0], 4, out=tmp_path / "s", dedup=False, symmetrize=False,
                       x=np.ones((4, 2)), y=np.array([0, 1, 1, -1]), splits={"train": [0], "test": [1, 2]})
    info = store_info(path, verify=True)
    assert (info["num_nodes"], info["num_edges"], info["num_features"], info["num_classes"]) == (4, 4, 2, 2)
    assert info["task"] == "binary" and info["labelled_nodes"] == 3
    assert info["splits"] == {"train": 1, "val": None, "test": 2}
    assert info["self_loops"] == 1 and info["duplicate_edges"] == 1 and info["isolated_nodes"] == 1
    assert not info["symmetric"] and info["verified"]
    assert info["in_degree"] == {"min": 0, "mean": 1.0, "median": 1.0, "max": 2}
    assert info["out_degree"]["max"] == 2
    assert info["memory_bytes"] == sum(a["bytes"] for a in info["arrays"].values())
    assert info["arrays"]["x"]["bytes"] == 4 * 2 * 4
    assert info["disk_bytes"] > info["memory_bytes"]  # .npy headers
    json.dumps(info)  # JSON-ready
    text = format_info(info)
    for word in ("nodes", "4", "self loops", "duplicate edges", "in-degree", "on disk", "in memory", "not symmetric"):
        assert word in text


def test_info_on_symmetric_store_small_chunks(sbm_store):
    a = store_info(sbm_store)
    b = store_info(sbm_store, chunk_edges=7)
    assert a["symmetric"] and a["sorted_rows"] and a["self_loops"] == 0 and a["duplicate_edges"] == 0
    assert {k: v for k, v in a.items() if k != "verified"} == {k: v for k, v in b.items() if k != "verified"}


def test_human_bytes():
    assert human_bytes(12) == "12 B" and human_bytes(1536) == "1.5 KiB" and human_bytes(3 * 2**30) == "3.0 GiB"
