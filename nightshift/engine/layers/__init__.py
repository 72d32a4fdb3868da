"""Building blocks of the model: linear layers (the INT4 seam)."""
