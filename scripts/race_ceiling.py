"""What any race decider could reach with the zoo's three Fashion-MNIST CNNs: each model's accuracy over the 10,000
test images, and the accuracy of combining them offline with everything each model knows (its whole softmax, not
the label and confidence a race answer carries): majority vote, mean of the probabilities, product of them, and a
logistic regression stacked on all thirty log-probabilities (5-fold cross-validated). Writes a JSON.

    python scripts/race_ceiling.py OUT.json [MODEL ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from scipy.special import softmax
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import cross_val_predict

from rampserve.bench.selection import cnn_logits
from rampserve.workloads.fashion_mnist import load_fashion_mnist

DEFAULT_MODELS = ("vgg11-fmnist", "resnet18-fmnist", "resnet50-fmnist")


def main(out: Path, models: tuple[str, ...]) -> None:
    images, labels = load_fashion_mnist("test")
    probabilities = np.stack([softmax(cnn_logits(name, images, 500), axis=1) for name in models])
    labels_by_model = probabilities.argmax(axis=2)
    backed = labels_by_model[..., None] == np.arange(probabilities.shape[2])  # (models, queries, labels)
    # Ties in the vote go to the label whose backers' confidences sum higher, as the learned decider breaks them
    # (a sum of confidences stays below 1 vote: fewer than len(models) + 1 of them, each at most 1)
    majority = (backed.sum(axis=0) + (backed * probabilities).sum(axis=0) / (len(models) + 1)).argmax(axis=1)
    stacked = cross_val_predict(LogisticRegression(max_iter=2000),
                                np.log(np.concatenate(probabilities, axis=1) + 1e-9), labels, cv=5)
    report = {
        "models": list(models), "queries": int(len(labels)),
        "alone": {name: float((labels_by_model[i] == labels).mean()) for i, name in enumerate(models)},
        "combined": {
            "majority": float((majority == labels).mean()),
            "mean_probability": float((probabilities.mean(axis=0).argmax(axis=1) == labels).mean()),
            "product_probability": float((np.log(probabilities + 1e-9).sum(axis=0).argmax(axis=1) == labels).mean()),
            "stacked_logistic_cv5": float((stacked == labels).mean()),
        },
        "some_model_right": float((labels_by_model == labels).any(axis=0).mean()),
        "every_model_right": float((labels_by_model == labels).all(axis=0).mean()),
    }
    best = max(report["alone"].values())
    report["best_alone"] = best
    report["best_combined_gain"] = max(report["combined"].values()) - best
    print(json.dumps(report, indent=1))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), tuple(sys.argv[2:]) or DEFAULT_MODELS)
