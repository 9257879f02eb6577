"""The one step pipeline: the steps in flight between the driver and the workers ([Note: one step pipeline])."""
