"""The registered training strategies: importing this package registers ``full``, ``mini``, ``cluster`` and ``pp``.

A new strategy is one module here with a :class:`~trellis.train.strategy.Strategy` subclass decorated by
:func:`~trellis.train.strategy.register_strategy`, imported below.
"""

from trellis.train.strategies import batch, dist_pp, full, pp
from trellis.train.strategy import STRATEGIES, Strategy, register_strategy, strategy_class

__all__ = ["STRATEGIES", "Strategy", "batch", "dist_pp", "full", "pp", "register_strategy", "strategy_class"]
