"""Models behind applications and how a server's set of them changes: predictors of every kind, applications
(selection, races), the catalogue and model repository, the shared state store and the model-update stream."""
