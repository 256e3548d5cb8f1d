"""DeepSpeed-Inference's door into the engine: ``init_inference(model, ...)`` on a loaded
transformers model (``engine.py``), configured by DeepSpeed's field names (``config.py``)."""

from engine.inference.config import InferenceConfig
from engine.inference.engine import InferenceEngine, init_inference

__all__ = ["InferenceConfig", "InferenceEngine", "init_inference"]
