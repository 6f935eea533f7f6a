"""``trellis.partition`` (trellis/partition/api.py): what it refuses to overwrite, and its seeds."""

from __future__ import annotations

import shutil

import pytest

import trellis
from trellis.data.store import open_store
from trellis.errors import TrellisUserError


@pytest.fixture()
def store_copy(sbm_store, tmp_path):
    return shutil.copytree(sbm_store, tmp_path / "store")


def test_a_store_is_never_replaced_by_a_layout(store_copy, sbm_store, tmp_path):
    """--out STORE --overwrite deleted the store, the one being partitioned included."""
    with pytest.raises(TrellisUserError, match="is not a partitioned layout"):
        trellis.partition(store_copy, 2, out=store_copy, overwrite=True)
    with pytest.raises(TrellisUserError, match="is not a partitioned layout"):
        trellis.partition(sbm_store, 2, out=store_copy, overwrite=True)
    assert open_store(store_copy).num_nodes == 500


def test_a_layout_holding_a_store_s_only_features_is_not_replaced(store_copy, sbm_store, tmp_path):
    trellis.partition(store_copy, 2, out=tmp_path / "lay", move_features=True)
    assert open_store(store_copy).moved_to("x") is not None
    with pytest.raises(TrellisUserError, match="holds the only copy of .*'s features"):
        trellis.partition(sbm_store, 3, out=tmp_path / "lay", overwrite=True)
    trellis.partition(sbm_store, 2, out=tmp_path / "plain")
    trellis.partition(sbm_store, 3, out=tmp_path / "plain", overwrite=True)  # an ordinary layout still is


@pytest.mark.parametrize("method", ["grem", "metis"])
def test_seeds_beyond_a_c_int_are_refused(sbm_store, method):
    """METIS takes its seed as a C int: a larger seed crashed it, or was silently cut to its low 32 bits."""
    for seed in (2**31, 2**64):
        with pytest.raises(TrellisUserError, match=r"--seed must be in \[0, 2147483647\]"):
            trellis.partition(sbm_store, 2, method=method, seed=seed)


@pytest.mark.parametrize(("option", "match"), [
    ({"refine": "no"}, "must be a bool"), ({"passes": 1.5}, "--passes must be an int"),
    ({"chunk_edges": 2.5}, "--chunk-edges must be an int"), ({"imbalance": "0.1"}, "--imbalance must be a float"),
])
def test_method_options_of_the_wrong_type_are_refused_as_the_cli_refuses_them(sbm_store, option, match):
    """They were coerced: refine="no" turned refinement on, passes=1.5 ran one pass."""
    with pytest.raises(TrellisUserError, match=match):
        trellis.partition(sbm_store, 2, **option)


def test_parts_dir_given_a_store_names_the_flag_and_the_fix(sbm_store):
    from trellis.partition.layout import open_layout_of

    with pytest.raises(TrellisUserError, match=r"--parts-dir .*: .* is a store: partition it with `trellis partition"):
        open_layout_of(sbm_store, open_store(sbm_store))
