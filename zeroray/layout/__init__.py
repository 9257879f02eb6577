"""The flat layout of the parameters (units, shards, ranges), the wrap policy, the stage policy and a
rank's local shard: pure, read off a module (the meta-device model works)."""
