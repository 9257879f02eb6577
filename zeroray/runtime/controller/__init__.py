"""The driver's state machine: the Controller, its policies, and what it delegates (recovery, checkpoints, resize)."""
