"""Lower tiers for the optimizer state: the disk tier ([Note: disk offload] in offload/stepper.py)."""
