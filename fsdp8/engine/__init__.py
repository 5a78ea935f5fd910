"""The sharding engine: fully_shard, its units, flat buffers, gathers and reductions, and the schedule."""
