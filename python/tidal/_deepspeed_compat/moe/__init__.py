"""deepspeed.moe: mixture-of-experts layers, which tidal does not have.

Importable, so the scripts that import it (the CIFAR-10 tutorial does, for
its --moe option) run without it: building a layer.MoE is refused by name;
moe.utils splits parameter groups as DeepSpeed's does when no parameter
belongs to an expert (the only case without MoE layers)."""
