"""monet_like: a schedule compiler for memory-bounded training.

The data flow: graph.capture -> profile.profile -> solver.solve -> schedule.build ->
ScheduleWrapper. Each stage is one module and hands a plain value to the next.

    from monet_like import ScheduleWrapper
"""

from monet_like._version import __version__
from monet_like.errors import UserError

__all__ = ["ScheduleWrapper", "UserError", "__version__"]


def __getattr__(name: str):
    # Imported on first use: `import monet_like` stays light (no torch import).
    if name == "ScheduleWrapper":
        from monet_like.wrapper import ScheduleWrapper

        return ScheduleWrapper
    raise AttributeError(f"module 'monet_like' has no attribute {name!r}")
