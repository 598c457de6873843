"""Pure scheduling decisions: no trio, no I/O, no clock reads (every decision takes ``now``)."""
