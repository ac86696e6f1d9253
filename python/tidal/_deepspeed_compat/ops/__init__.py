"""deepspeed.ops: DeepSpeed's optimizers. adam (DeepSpeedCPUAdam, FusedAdam)
runs; lamb, lion and adagrad are importable and refused when built."""
