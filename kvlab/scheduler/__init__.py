"""What runs each step: the Scheduler (pure Python) and the plan it hands the runner."""

from kvlab.scheduler.scheduler import ScheduledChunk, Scheduler, SchedulerConfig, SchedulerOutput

__all__ = ["ScheduledChunk", "Scheduler", "SchedulerConfig", "SchedulerOutput"]
