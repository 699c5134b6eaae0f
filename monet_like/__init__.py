"""monet_like: a schedule compiler for memory-bounded training.

The data flow: graph.capture -> profile.profile -> solver.solve -> schedule.build ->
ScheduleWrapper. Each stage is one module and hands a plain value to the next.

    from monet_like import ScheduleWrapper
"""

__version__ = "0.1.0"

from monet_like.errors import UserError  # noqa: E402

__all__ = ["ScheduleWrapper", "UserError", "__version__"]


def __getattr__(name: str):
    # Imported on first use: `import monet_like` stays light (no torch import).
    if name == "ScheduleWrapper":
        from monet_like.wrapper import ScheduleWrapper

        return ScheduleWrapper
    raise AttributeError(f"module 'monet_like' has no attribute {name!r}")
