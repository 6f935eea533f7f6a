"""trellis.partition: partitioners (by name), the PartitionBook, quality reports and the partitioned layout.

Typical use::

    from trellis.data.store import open_store
    from trellis.partition import partition_graph, evaluate, write_layout, open_partitioned

    store = open_store("graph/")
    book = partition_graph(store, "grem", 8, chunk_frac=0.1, seed=0)
    print(evaluate(store, book).table())
    write_layout(store, book, "graph.parts8/")
    local = open_partitioned("graph.parts8/").part(3)   # local CSR + halo of part 3
"""

import sys
import types
from typing import Any

from trellis.partition.base import (
    DEFAULT_IMBALANCE,
    OWNERSHIPS,
    PartitionBook,
    Partitioner,
    available_methods,
    create_partitioner,
    get_partitioner,
    part_cap,
    partition_graph,
    register,
)
from trellis.partition.layout import (
    EdgeBucket,
    LocalGraph,
    PartitionedGraph,
    load_partition_book,
    open_partitioned,
    write_layout,
)
from trellis.partition.quality import PartitionQuality, evaluate

__all__ = [
    "DEFAULT_IMBALANCE", "OWNERSHIPS", "EdgeBucket", "LocalGraph", "PartitionBook", "PartitionQuality",
    "PartitionedGraph", "Partitioner", "available_methods", "create_partitioner", "evaluate", "get_partitioner",
    "load_partition_book", "open_partitioned", "part_cap", "partition_graph", "register", "write_layout",
]



class _CallableModule(types.ModuleType):
    """``trellis.partition(store, parts=P, out=DIR)`` is :func:`trellis.partition.api.partition`."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from trellis.partition.api import partition

        return partition(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
