"""Requests, sampling parameters, the per-step batch, and the Dynamic SplitFuse scheduler.
Pure Python: integers and lists."""

from scheduler.batch import BatchRow, NewRequestData, ScheduledBatch
from scheduler.request import Request, RequestStatus
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler

__all__ = [
    "BatchRow",
    "NewRequestData",
    "Request",
    "RequestStatus",
    "SamplingParams",
    "ScheduledBatch",
    "Scheduler",
]
