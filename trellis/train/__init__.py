"""trellis.train: strategies, the one trainer loop, runs, sweeps and tuning.

The module is callable: ``trellis.train(graph, model="gcn", epochs=50)`` is :func:`trellis.train.api.train`
(the package and the front-door function share the name, as DESIGN.md's front door asks).
"""

import sys
import types
from typing import Any


class _CallableModule(types.ModuleType):
    """``trellis.train(...)`` trains; ``trellis.train.trainer`` and the other submodules import as usual."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from trellis.train.api import train

        return train(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
