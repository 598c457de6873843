"""Typed facade over the CalRT C binding (``calserve._calrt``). No trio here."""

from calserve.runtime.device import QUEUE_DEPTH, Calbin, Device, Job, corrupted_lanes, logits_checksum
from calserve.runtime.types import *  # noqa: F403
from calserve.runtime.types import __all__ as _types_all

__all__ = [
    "Device",
    "Calbin",
    "Job",
    "QUEUE_DEPTH",
    "logits_checksum",
    "corrupted_lanes",
    *_types_all,
]
