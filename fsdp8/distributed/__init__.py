"""The distributed foundation: process groups and device choice, meshes, collectives on streams,
the hang watchdog and the cross-rank checks that run before a collective could hang."""
