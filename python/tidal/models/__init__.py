"""Models tidal trains out of the box."""
