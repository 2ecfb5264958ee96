"""Save the zoo's minilm-rt as a plain Hugging Face folder (`save_pretrained`, with its tokenizer.json): the model as
a user would bring it, `hf:DIR`, to serve unprepared or to prepare on their own data. Checks that the folder answers
as the zoo model does on the first texts of rt-drift.

    python scripts/zoo_as_hf.py DIR
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import BertForSequenceClassification

from rampserve.workloads.streams import get_stream
from rampserve.zoo.hf_encoders import TOKENIZER_FILE, from_pretrained_dir, text_encoder
from rampserve.zoo.minilm import NUM_CLASSES, encode_texts, load_config, model_dir
from rampserve.zoo.registry import load_trained

CHECKED_TEXTS = 256


def hf_key(key: str) -> str:
    """A minilm-rt weight's name in BertForSequenceClassification."""
    if key.startswith("embeddings."):
        return f"bert.{key}"
    if key.startswith("layers."):
        index, rest = key.removeprefix("layers.").split(".", 1)
        return f"bert.encoder.layer.{index}.{rest.removeprefix('layer.')}"
    return key.replace("head.dense.", "bert.pooler.dense.").replace("head.out.", "classifier.")


def main(out: Path) -> None:
    zoo = load_trained("minilm-rt")
    config = load_config()
    config.num_labels = NUM_CLASSES
    model = BertForSequenceClassification(config).eval()
    missing, unexpected = model.load_state_dict({hf_key(k): v for k, v in zoo.state_dict().items()}, strict=False)
    if unexpected or [k for k in missing if not k.endswith("position_ids")]:
        raise SystemExit(f"minilm-rt's weights do not fit BertForSequenceClassification: missing {missing}, "
                         f"unexpected {unexpected}")
    model.save_pretrained(out)
    shutil.copyfile(model_dir() / TOKENIZER_FILE, out / TOKENIZER_FILE)
    texts = get_stream("rt-drift").items(0, CHECKED_TEXTS)
    with torch.inference_mode():
        ours = zoo(**{k: torch.from_numpy(v) for k, v in encode_texts(texts).items()}).argmax(1).numpy()
        saved = from_pretrained_dir(out)(**{k: torch.from_numpy(v) for k, v in text_encoder(out)(texts).items()})
    agreement = float(np.mean(ours == saved.argmax(1).numpy()))
    if agreement < 1.0:
        raise SystemExit(f"{out} agrees with minilm-rt on {agreement:.1%} of {CHECKED_TEXTS} texts, not all")
    print(f"wrote minilm-rt to {out} (hf:{out}); it answers as the zoo model on rt-drift's first {CHECKED_TEXTS} texts")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
