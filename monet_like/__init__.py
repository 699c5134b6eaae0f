"""monet_like: a schedule compiler for memory-bounded training.

The data flow: graph.capture -> profile.profile -> solver.solve -> schedule.build ->
ScheduleWrapper. Each stage is one module and hands a plain value to the next.

    import monet_like
    compiled = monet_like.compile(model, (3, 224, 224), 32, budget_bytes=4 * 2**30,
                                  output="schedule.json")
    wrapped = monet_like.ScheduleWrapper(model, "schedule.json", (3, 224, 224))
"""

from monet_like._version import __version__
from monet_like.errors import UserError

__all__ = ["ScheduleWrapper", "UserError", "__version__", "compile", "largest_batch"]


def __getattr__(name: str):
    # Imported on first use: `import monet_like` stays light (no torch import).
    if name == "ScheduleWrapper":
        from monet_like.wrapper import ScheduleWrapper

        return ScheduleWrapper
    if name == "compile":  # the whole pipeline: monet_like.pipeline.compile_schedule
        from monet_like.pipeline import compile_schedule

        return compile_schedule
    if name == "largest_batch":  # solve.py MODEL auto ...
        from monet_like.batch_search import largest_batch

        return largest_batch
    raise AttributeError(f"module 'monet_like' has no attribute {name!r}")
