"""The inference stage: apply a trained model to whole volumes (``bigmem-train predict``)."""
