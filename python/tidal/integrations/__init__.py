"""Integrations of tidal's engine with other training loops.

    from tidal.integrations import TidalTrainer      # Hugging Face transformers.Trainer

TidalTrainer needs transformers (and accelerate); importing this package
imports them.
"""
from .hf_config import trainer_config
from .hf_trainer import TidalTrainer

__all__ = ["TidalTrainer", "trainer_config"]
