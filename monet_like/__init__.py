"""monet_like: a schedule compiler for memory-bounded training.

The data flow (see docs/ and DESIGN): graph.capture -> profile.profile ->
solver.solve -> schedule.build -> ScheduleWrapper. Each stage is one module and
hands a plain value to the next.
"""

__version__ = "0.1.0"

from monet_like.errors import UserError  # noqa: E402

__all__ = ["UserError", "__version__"]
