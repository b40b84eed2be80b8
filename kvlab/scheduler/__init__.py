"""What runs each step: the Scheduler (pure Python), the plan it hands the runner, and the result it takes back."""

from kvlab.scheduler.scheduler import ScheduledChunk, Scheduler, SchedulerConfig, SchedulerOutput, StepResult

__all__ = ["ScheduledChunk", "Scheduler", "SchedulerConfig", "SchedulerOutput", "StepResult"]
