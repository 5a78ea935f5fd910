"""``fsdp8 bench``: a configuration trained here and measured beside the planner's prediction, and the
tools that measure (the host probe, loopback collectives, step profiles, memory peaks)."""
