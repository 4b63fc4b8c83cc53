"""WGSL kernel ops: each op builds its pipeline and bind groups once and records dispatches per step."""
