"""deepspeed.runtime: its zero package (runtime/zero)."""
