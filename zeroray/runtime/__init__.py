"""Everything that imports ray: the worker actor, its group, the driver's controller and ``zr.Trainer``."""
