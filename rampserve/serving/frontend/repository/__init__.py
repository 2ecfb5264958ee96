"""What a server serves and how that changes while it serves: models of every kind behind one `Predictor`
interface (`predictors`), and the catalogue of models and applications with the versioned model repository on disk
they are loaded from (`catalogue`)."""
