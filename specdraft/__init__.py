"""specdraft core: draft models, masks, losses, training stages, decoding and the feature-store reader.

Pure torch + transformers + safetensors; never imports prefect, ray or mlflow.
"""

__version__ = "0.1.0"
