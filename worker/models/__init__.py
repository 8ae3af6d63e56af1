"""Model implementations (one flat file per architecture), their registry and loader.

Importing this package does not import transformers; the loader does so lazily for configs.
"""

from worker.models.loader import build_model, load_model
from worker.models.registry import model_class, supported_model_types

__all__ = ["build_model", "load_model", "model_class", "supported_model_types"]
