"""Stage 0-3 coordinators: the lifecycle every stage's coordinator follows (lifecycle.py), stage 3's
unit fetcher (unit_fetcher.py) and stages 1-2's update publisher (publish.py), built by build.py; the
trace and schedule, negotiated fetches, the units, the module hooks and parameter access they build on."""
