"""Distributed training on torch.distributed: one rank per part of a partitioned layout.

Importing this package registers the partition-parallel ``full`` strategy (``--parts-dir``).
"""

from trellis.dist import strategy

__all__ = ["strategy"]
