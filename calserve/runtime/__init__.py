"""Typed facade over the CalRT C binding (``calserve._calrt``). No trio here."""

from calserve.runtime.binding import bad_lanes, corrupted_lanes, logits_checksum, verify_lanes
from calserve.runtime.device import QUEUE_DEPTH, Calbin, Device, Job
from calserve.runtime.types import *  # noqa: F403
from calserve.runtime.types import __all__ as _types_all

__all__ = [
    "Device",
    "Calbin",
    "Job",
    "QUEUE_DEPTH",
    "logits_checksum",
    "corrupted_lanes",
    "bad_lanes",
    "verify_lanes",
    *_types_all,
]
