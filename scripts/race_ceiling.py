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
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import cross_val_predict
from tqdm import tqdm

from rampserve.workloads.fashion_mnist import load_fashion_mnist
from rampserve.zoo import get_entry, load_trained

DEFAULT_MODELS = ("vgg11-fmnist", "resnet18-fmnist", "resnet50-fmnist")


def softmax_outputs(name: str, images: np.ndarray, batch: int = 500) -> np.ndarray:
    model, entry = load_trained(name).eval(), get_entry(name)
    out = []
    with torch.inference_mode():
        for start in tqdm(range(0, len(images), batch), desc=name, unit="batch"):
            feeds = entry.encode(images[start:start + batch])
            out.append(torch.softmax(model(*(torch.from_numpy(np.array(v)) for v in feeds.values())),
                                     -1).numpy())
    return np.concatenate(out)


def main(out: Path, models: tuple[str, ...]) -> None:
    images, labels = load_fashion_mnist("test")
    probabilities = np.stack([softmax_outputs(name, images) for name in models])
    labels_by_model = probabilities.argmax(axis=2)
    votes = np.stack([(labels_by_model == k).sum(axis=0) for k in range(probabilities.shape[2])], axis=1)
    # Ties in the vote go to the label with the higher summed probability, as the deciders break them
    majority = (votes + probabilities.sum(axis=0) / (len(models) + 1)).argmax(axis=1)
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
