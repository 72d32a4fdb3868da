"""Domain layer: models, batch/shard state machine, validation, planning (no torch here)."""
