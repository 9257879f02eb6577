"""Stage 1-3 parameter fetching: the coordinators that decide when each unit is gathered, waited for
and freed, the trace and schedule, negotiated fetches, the units and parameter access."""
