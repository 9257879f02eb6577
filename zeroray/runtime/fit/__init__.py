"""fit: the loop over the step pipeline, its data feeds, evaluations and progress."""
