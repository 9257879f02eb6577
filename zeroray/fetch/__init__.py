"""Stage 1-3 parameter fetching: the stage-3 coordinator (coordinator.py) and the stages 1-2 publish
(publish.py), chosen by factory.py; the trace and schedule, negotiated fetches, the units, the module
hooks and parameter access they build on."""
