"""Typed facade over the CalRT C binding (``calserve._calrt``). No trio here."""
