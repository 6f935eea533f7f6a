from __future__ import annotations

import gzip

import numpy as np
import pytest

from trellis.data.csr import read_all_edges
from trellis.data.textio import NpyEdgeSource, TextEdgeSource, iter_blocks, read_table
from trellis.errors import TrellisUserError


def _edges(path, chunk=2_000_000, n=None):
    return read_all_edges(TextEdgeSource(path, chunk_edges=chunk), n)


@pytest.mark.parametrize("sep", [" ", "\t", ",", ", ", "  \t "])
def test_separators_comments_blank_lines(tmp_path, sep):
    p = tmp_path / "edges.txt"
    p.write_text(f"# header comment\n0{sep}1\n\n1{sep}2  # trailing comment\r\n2{sep}0\n3{sep}3")
    src, dst = _edges(p)
    assert src.tolist() == [0, 1, 2, 3] and dst.tolist() == [1, 2, 0, 3]


@pytest.mark.parametrize("chunk", [None, 1])
def test_a_utf8_byte_order_mark_is_not_part_of_the_first_id(tmp_path, chunk):
    """Excel's "CSV UTF-8" starts with a byte-order mark: the import refused line 1 ('\\ufeff0' not an integer)."""
    p = tmp_path / "edges.csv"
    p.write_bytes(b"\xef\xbb\xbf0,1\n1,2\n2,0\n")
    src, dst = _edges(p) if chunk is None else _edges(p, chunk=chunk)
    assert src.tolist() == [0, 1, 2] and dst.tolist() == [1, 2, 0]
    q = tmp_path / "x.csv"
    q.write_bytes(b"\xef\xbb\xbf1.5,2\n3,4\n")
    np.testing.assert_array_equal(read_table(q, ncols=2), [[1.5, 2], [3, 4]])


def test_gzip_and_tiny_blocks_keep_line_numbers(tmp_path):
    lines = [f"{i} {i + 1}" for i in range(100)] + ["5 x"] + ["1 2"] * 10
    p = tmp_path / "edges.txt.gz"
    with gzip.open(p, "wt") as f:
        f.write("\n".join(lines) + "\n")
    with pytest.raises(TrellisUserError, match=r"edges.txt.gz: line 101: 'x' is not an integer"):
        _edges(p, chunk=1)  # 16-byte blocks: many blocks, line numbers must still be exact
    with gzip.open(p, "wt") as f:
        f.write("\n".join(lines[:100]) + "\n")
    src, dst = _edges(p, chunk=1)
    assert src.tolist() == list(range(100)) and dst.tolist() == list(range(1, 101))


def test_blocks_cover_file_exactly(tmp_path):
    p = tmp_path / "t.txt"
    text = "".join(f"{i} {i}\n" for i in range(1000)) + "7 7"  # no trailing newline
    p.write_text(text)
    blocks = list(iter_blocks(p, 37))
    assert b"".join(b for b, _ in blocks).decode() == text
    lines = [first for _, first in blocks]
    assert lines[0] == 1 and lines == sorted(lines)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("0 1\n1 2.5\n", "line 2: '2.5' is not an integer"),
        ("0 1\n# c\n\n1 2 3\n", "line 4: expected 2 columns .* found 3"),
        ("src dst\n0 1\n", "line 1: 'src' is not an integer .* header"),
        ("0 1\n1\n", "line 2: expected 2 columns"),
        ("0 1\n# c\n3 -4\n", "line 3: negative node id"),
        ("0 1\n1 99999999999999999999\n", "line 2: '99999999999999999999' does not fit in 64 bits"),
    ],
)
def test_errors_name_file_and_line(tmp_path, content, match):
    p = tmp_path / "edges.txt"
    p.write_text(content)
    with pytest.raises(TrellisUserError, match=match):
        _edges(p)


def test_id_out_of_range_names_line(tmp_path):
    p = tmp_path / "edges.txt"
    p.write_text("0 1\n# skip\n1 9\n")
    with pytest.raises(TrellisUserError, match="line 3: node id 9 but the graph has 5 nodes"):
        _edges(p, n=5)


def test_read_table_floats_and_width(tmp_path):
    p = tmp_path / "f.csv"
    p.write_text("1.5,2\n3,nan\n")
    arr = read_table(p, dtype=np.float32)
    assert arr.shape == (2, 2) and np.isnan(arr[1, 1])
    p.write_text("1,2\n3\n")
    with pytest.raises(TrellisUserError, match="line 2"):
        read_table(p, dtype=np.float32)


def test_npy_edges(tmp_path):
    p = tmp_path / "edges.npy"
    np.save(p, np.array([[0, 1], [1, 2]]))
    src, dst = read_all_edges(NpyEdgeSource(p, chunk_edges=1))
    assert src.tolist() == [0, 1] and dst.tolist() == [1, 2]
    np.save(p, np.array([[0, 1, 2], [1, 2, 0]]))
    with pytest.raises(TrellisUserError, match=r"\[E, 2\].*edge_index.T"):
        NpyEdgeSource(p)
    np.save(p, np.array([[0.0, 1.0], [1.0, 2.5]]))
    with pytest.raises(TrellisUserError, match="row 1 has non-integer node id 2.5"):
        read_all_edges(NpyEdgeSource(p))
    np.save(p, np.array([[0, 1], [-3, 2]]))
    with pytest.raises(TrellisUserError, match="row 1 has negative node id -3"):
        read_all_edges(NpyEdgeSource(p))


def test_missing_file(tmp_path):
    with pytest.raises(TrellisUserError, match="file not found"):
        TextEdgeSource(tmp_path / "nope.txt")
