"""Applications over the served models (selection, races), the shared state store they keep their weights in, and
the model-update stream."""
