"""Building a model so that no worker holds all of it: sharded construction and freed storage."""
