"""trellis.data: the on-disk graph store, importers, generators and Python adapters.

Public API::

    open_store(path) -> GraphStore                 memory-mapped, checked store
    write_store(out, indptr=..., indices=..., ...) write in-memory arrays
    import_graph(src, out, format=None, ...)      planetoid | npz | ogb | edgelist
    from_arrays / from_scipy / from_networkx / from_pyg
    generate_sbm(out, nodes=..., ...) / generate_rmat(out, nodes=..., ...)
    edges_to_csr(src, dst, ...) / build_csr_chunked(source, writer, ...)
    store_info(path) -> dict / format_info(info) -> str
"""

from trellis.data.convert import from_arrays, from_networkx, from_pyg, from_scipy
from trellis.data.csr import EdgeCSR, build_csr_chunked, edges_to_csr
from trellis.data.generate import generate_rmat, generate_sbm
from trellis.data.importers import (
    FORMATS,
    detect_format,
    import_edgelist,
    import_graph,
    import_npz,
    import_ogb,
    import_planetoid,
)
from trellis.data.info import format_info, store_info
from trellis.data.splits import per_class_split, random_split
from trellis.data.store import GraphStore, StoreWriter, open_store, store_writer, write_store
from trellis.utils.csr import build_reverse_csr

__all__ = [
    "FORMATS",
    "EdgeCSR",
    "GraphStore",
    "StoreWriter",
    "build_csr_chunked",
    "build_reverse_csr",
    "detect_format",
    "edges_to_csr",
    "format_info",
    "from_arrays",
    "from_networkx",
    "from_pyg",
    "from_scipy",
    "generate_rmat",
    "generate_sbm",
    "import_edgelist",
    "import_graph",
    "import_npz",
    "import_ogb",
    "import_planetoid",
    "open_store",
    "per_class_split",
    "random_split",
    "store_info",
    "store_writer",
    "write_store",
]
