"""Your model, your inputs: `rampserve prepare MODEL --data PATH` on models and data that neither the zoo nor the
streams hold, made here: a small CNN trained on scikit-learn's handwritten digits and exported to ONNX, and a tiny
BERT sequence classifier (a WordPiece tokenizer built with `tokenizers`) trained on sentences of the Python standard
library's docstrings. Every format gives a bundle whose answers are the original model's; every kind of bad data
gets an error naming what was expected and what came, and leaves nothing behind."""

from __future__ import annotations

import importlib
import inspect
import json
import re
import urllib.request
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import safetensors.numpy
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from rampserve.cli import app
from rampserve.ramps.train import TrainConfig, split_indices
from rampserve.runtime.bundle import load_bundle, save_bundle
from rampserve.runtime.prepare import PrepareConfig, min_own_inputs, prepare, prepared_encoder, reprofile
from rampserve.runtime.sources import ModelSource
from rampserve.runtime.user_data import (
    DataError,
    DataOptions,
    ExpectedInput,
    ImageOptions,
    ModelInputs,
    TensorRows,
    UserData,
    read_request_log,
    read_user_data,
)
from rampserve.zoo.hf_encoders import text_encoder

# --- the models ---------------------------------------------------------------------------------------------------

SIDE = 16  # the digits' 8x8 pixels, doubled


def digit_pixels() -> np.ndarray:
    """scikit-learn's 1,797 handwritten digits (bundled, offline) as uint8 16x16 grey images."""
    from sklearn.datasets import load_digits

    images = load_digits().images  # 0..16
    return np.rint(np.kron(images, np.ones((2, 2))) * (255 / 16)).astype(np.uint8)


def digit_inputs(pixels: np.ndarray) -> np.ndarray:
    """What the CNN takes: (N, 1, 16, 16) float32, pixels scaled to [0, 1] then normalized by mean 0.5, std 0.5."""
    return ((pixels.astype(np.float32) / 255 - 0.5) / 0.5)[:, None]


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> tuple[Path, np.ndarray]:
    """The digits CNN as an ONNX file (with the Hugging Face image processor settings beside it), and its inputs."""
    from sklearn.datasets import load_digits

    from rampserve.graph.onnx_graph import export_onnx

    torch.manual_seed(0)
    x = torch.from_numpy(digit_inputs(digit_pixels()))
    y = torch.from_numpy(load_digits().target)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(8, 16, 3, padding=1, stride=2), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 16, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1, stride=2), torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(6):
        for batch in torch.randperm(len(x)).split(64):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            optimizer.step()
    model.eval()
    assert (model(x).argmax(1) == y).float().mean() > 0.8  # it learnt the digits
    directory = tmp_path_factory.mktemp("digits-model")
    path = export_onnx(model, (x[:2],), ["image"], directory / "digits.onnx")
    (directory / "preprocessor_config.json").write_text(json.dumps({
        "do_resize": True, "size": {"height": SIDE, "width": SIDE}, "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "image_mean": [0.5], "image_std": [0.5], "resample": 2}))
    return path, x.numpy()


def docstring_sentences() -> tuple[list[str], np.ndarray]:
    """Distinct sentences of the standard library's docstrings, labelled by what their module is about (text, files
    and processes, or numbers and collections)."""
    groups = (("re", "string", "textwrap", "difflib", "csv", "json", "codecs", "unicodedata", "html", "email.message",
               "argparse", "gettext"),
              ("os", "shutil", "pathlib", "tempfile", "glob", "zipfile", "tarfile", "subprocess", "io", "stat",
               "socket", "threading", "logging", "sqlite3"),
              ("collections", "itertools", "functools", "heapq", "bisect", "statistics", "random", "math",
               "decimal", "fractions", "datetime", "operator", "array", "enum"))
    found: dict[str, int] = {}
    for label, names in enumerate(groups):
        for name in names:
            module = importlib.import_module(name)
            docs = [inspect.getdoc(module)] + [inspect.getdoc(getattr(module, a)) for a in dir(module)
                                               if not a.startswith("_")]
            for doc in filter(None, docs):
                for sentence in re.split(r"(?<=[.!?])\s+", " ".join(doc.split())):
                    if 4 <= len(sentence.split()) <= 30 and re.search("[a-z]", sentence) and ">>>" not in sentence:
                        found.setdefault(sentence, label)
    return list(found), np.array(list(found.values()))


@pytest.fixture(scope="module")
def sentences() -> list[str]:
    texts, _ = docstring_sentences()
    assert len(texts) > 2000
    return texts


@pytest.fixture(scope="module")
def text_model(tmp_path_factory) -> Path:
    """A 3-layer BERT sequence classifier saved by save_pretrained, with its own WordPiece tokenizer.json, trained
    briefly on the docstring sentences."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertConfig, BertForSequenceClassification

    texts, labels = docstring_sentences()
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.train_from_iterator(texts, trainers.WordPieceTrainer(
        vocab_size=1500, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", tokenizer.token_to_id("[CLS]")),
                                                 ("[SEP]", tokenizer.token_to_id("[SEP]"))])
    torch.manual_seed(0)
    config = BertConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=32, num_hidden_layers=3,
                        num_attention_heads=4, intermediate_size=64, max_position_embeddings=80, num_labels=3,
                        pad_token_id=tokenizer.token_to_id("[PAD]"))
    model = BertForSequenceClassification(config)
    tokenizer.enable_padding(pad_id=config.pad_token_id)
    tokenizer.enable_truncation(64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    order = np.random.default_rng(0).permutation(len(texts))
    for batch in np.array_split(order, len(order) // 32):
        encoded = tokenizer.encode_batch([texts[i] for i in batch])
        ids = torch.tensor([e.ids for e in encoded])
        mask = torch.tensor([e.attention_mask for e in encoded])
        optimizer.zero_grad()
        model(input_ids=ids, attention_mask=mask, labels=torch.from_numpy(labels[batch])).loss.backward()
        optimizer.step()
    directory = tmp_path_factory.mktemp("text-model") / "docstring-bert"
    model.eval().save_pretrained(directory)
    tokenizer.no_padding()
    tokenizer.no_truncation()
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def transformers_labels(directory: Path, texts: list[str]) -> np.ndarray:
    """The saved classifier's own labels, through transformers and the tokenizer as a user would call them."""
    from tokenizers import Tokenizer
    from transformers import BertForSequenceClassification

    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.enable_truncation(64)
    model = BertForSequenceClassification.from_pretrained(directory, attn_implementation="eager").eval()
    labels = []
    with torch.inference_mode():
        for text in texts:
            ids = torch.tensor([tokenizer.encode(text).ids])
            labels.append(int(model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.argmax()))
    return np.array(labels)


# --- preparing ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def own_config(small_prepare_config):
    return replace(small_prepare_config, bootstrap_items=1100)


def prepared_bundle(source: str, data: Path, config, out: Path, **options) -> Path:
    engine = "onnxruntime" if source.endswith(".onnx") else "torch"
    return save_bundle(prepare(ModelSource.parse(source), replace(config, data=data, engine=engine, **options)), out)


def bundle_labels(bundle: Path, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """The bundle's final answers, every ramp active."""
    model = load_bundle(bundle)
    return np.asarray(model.run(feeds, model.site_names)).argmax(axis=1)


def onnx_labels(path: Path, images: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(str(path)).run(None, {"image": images})[0].argmax(axis=1)


@pytest.mark.parametrize("suffix", [".npy", ".npz", ".safetensors"])
def test_tensor_files_prepare_a_bundle_that_answers_as_the_onnx_model(digits, own_config, tmp_path, suffix) -> None:
    path, images = digits
    data = tmp_path / f"digits{suffix}"
    if suffix == ".npy":
        np.save(data, images)
    elif suffix == ".npz":
        np.savez(data, image=images)
    else:
        safetensors.numpy.save_file({"image": images}, data)
    bundle = prepared_bundle(str(path), data, own_config, tmp_path / "bundle")
    meta = json.loads((bundle / "manifest.json").read_text())["meta"]
    assert meta["workload"] is None and meta["data"]["format"] == suffix[1:]
    assert meta["data"]["rows"] == len(images) and meta["data"]["bootstrap_inputs"] == 1100
    # the last tenth of the 1,100 inputs, in the file's order, validated the ramps
    assert meta["training"]["num_val"] == 110 == meta["data"]["validation_inputs"]
    one = images[-1:]  # an input the ramps never saw
    assert bundle_labels(bundle, {"image": one}) == onnx_labels(path, one)
    if suffix == ".npz":  # `rampserve profile` measures again on the rows it learnt from; `inspect` names them
        profile = reprofile(load_bundle(bundle), own_config)
        assert profile.sites == tuple(meta["oracle_val"]["exit_counts"])[:-1]
        shown = CliRunner().invoke(app, ["inspect", str(bundle)])
        assert shown.exit_code == 0 and "Ramps trained on the 1100 distinct inputs of rows 1-1100 of 1797" in \
            " ".join(shown.output.split())


def test_texts_in_each_format_prepare_a_bundle_that_answers_as_the_classifier(text_model, sentences, own_config,
                                                                              tmp_path) -> None:
    files = {"txt": "\n".join(sentences) + "\n",
             "jsonl": "\n".join(json.dumps({"id": i, "sentence": s}) for i, s in enumerate(sentences)),
             "csv": "id,text\n" + "\n".join(f'{i},"{s.replace(chr(34), chr(34) * 2)}"' for i, s in
                                            enumerate(sentences))}
    probe = sentences[-3:]
    expected = transformers_labels(text_model, probe)
    for suffix, content in files.items():
        data = tmp_path / f"sentences.{suffix}"
        data.write_text(content)
        options = {"data_options": replace(own_config.data_options, text_field="sentence")} \
            if suffix == "jsonl" else {}
        bundle = prepared_bundle(f"hf:{text_model}", data, own_config, tmp_path / f"bundle-{suffix}", **options)
        model = load_bundle(bundle)
        assert model.meta["data"]["format"] == suffix and model.meta["data"]["bootstrap_inputs"] == 1100
        assert model.meta["task"] == "text" and model.signature.inputs[0].shape == (-1, -1)
        feeds = prepared_encoder(model, "text")(probe)  # the tokenizer the bundle carries
        assert np.array_equal(bundle_labels(bundle, feeds), expected), suffix


def test_a_folder_of_images_is_preprocessed_as_the_models_image_processor_says(digits, own_config, tmp_path) -> None:
    from PIL import Image

    path, images = digits
    folder = tmp_path / "scans"
    folder.mkdir()
    pixels = digit_pixels()
    for i, image in enumerate(pixels[:1100]):  # drawn twice as large: preprocessing resizes them back
        Image.fromarray(np.kron(image, np.ones((2, 2), np.uint8))).save(folder / f"{i:05d}.png")
    (folder / "notes.txt").write_text("not an image: left out")
    bundle = prepared_bundle(str(path), folder, own_config, tmp_path / "bundle")
    meta = json.loads((bundle / "manifest.json").read_text())["meta"]
    assert meta["data"]["format"] == "images" and meta["data"]["rows"] == 1100
    assert meta["data"]["preprocessing"] | {"resample": 2} == {
        "height": SIDE, "width": SIDE, "channels": 1, "layout": "nchw", "mean": [0.5], "std": [0.5],
        "rescale": 1 / 255, "shortest_edge": None, "resample": 2}
    read = read_user_data(folder, ModelInputs((ExpectedInput("image", "FP32", (-1, 1, SIDE, SIDE)),),
                                              model_dir=path.parent))
    # as Hugging Face's image processor does it: PIL's bilinear resize, then rescale and normalize
    expected = [np.asarray(Image.open(folder / f"{i:05d}.png").resize((SIDE, SIDE), Image.Resampling.BILINEAR),
                           np.float32) for i in (0, 1099)]
    np.testing.assert_allclose(read.items.arrays["image"][[0, -1], 0], (np.stack(expected) / 255 - 0.5) / 0.5,
                               atol=1e-6)
    one = read.items.arrays["image"][-1:]
    assert bundle_labels(bundle, {"image": one}) == onnx_labels(path, one)


def v2_request(inputs: dict[str, np.ndarray], nested: bool) -> str:
    """A v2 infer request body, as POSTed as JSON."""
    datatypes = {np.dtype(np.float32): "FP32", np.dtype(np.int64): "INT64"}
    return json.dumps({"id": "r", "inputs": [
        {"name": name, "shape": list(a.shape), "datatype": datatypes[a.dtype],
         "data": a.tolist() if nested else a.ravel().tolist()} for name, a in inputs.items()]})


def test_a_request_log_of_token_ids_and_texts_prepares_a_text_model_that_serves(text_model, sentences, own_config,
                                                                                tmp_path) -> None:
    """The log a server records: each line a v2 body as the HTTP route accepts it (checked with the server's own
    parser), some with token ids of their own length (nested or flat data, batches of one to three), some with
    the texts themselves."""
    from rampserve.serving.executor.loading import load_served
    from rampserve.serving.server import ServerSettings, build_state, running_server
    from rampserve.serving.shared.protocol import parse_infer_request
    from rampserve.serving.shared.settings import ModelSettings

    encode = text_encoder(text_model)
    lines, start = [], 0
    while start < 1150:
        batch = sentences[start:start + 1 + start % 3]
        if start % 5 == 0:
            lines.append(json.dumps({"inputs": [{"name": "text", "shape": [len(batch)], "datatype": "BYTES",
                                                 "data": batch}]}))
        else:
            lines.append(v2_request(encode(batch), nested=start % 2 == 0))
        start += len(batch)
    log = tmp_path / "requests.jsonl"
    log.write_text("\n".join(lines) + "\n")
    bundle = prepared_bundle(f"hf:{text_model}", log, own_config, tmp_path / "bundle")
    model = load_bundle(bundle)
    assert model.meta["data"]["format"] == "requests" and model.meta["data"]["rows"] == start

    served = load_served(str(bundle))
    token_lines = [line for line in lines if "BYTES" not in line]
    for line in token_lines[:20]:
        parse_infer_request(line.encode(), None, served.inputs)  # the server's HTTP route takes the line as it is
    probe = sentences[start:start + 2]
    encoded = prepared_encoder(model, "text")(probe)
    expected = transformers_labels(text_model, probe)
    state = build_state([served], ModelSettings(), ServerSettings(port=0, grpc=False))
    with running_server(state, ServerSettings(port=0, grpc=False)) as url:  # a request as the log's lines were sent
        request = urllib.request.Request(f"{url}/v2/models/{bundle.name}/infer", v2_request(encoded, True).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = {o["name"]: o["data"] for o in json.loads(response.read())["outputs"]}
    assert answer["label"] == expected.tolist()


@settings(max_examples=30, deadline=None)
@given(rows=st.lists(st.lists(st.integers(5, 99), min_size=1, max_size=9), min_size=1, max_size=8),
       cut=st.data())
def test_token_rows_of_any_lengths_come_back_as_sent_and_batches_pad_to_their_longest(rows, cut) -> None:
    """A log's token rows, one request each, padded with the tokenizer's own pad values: any run of them is the
    batch the tokenizer would make of the same rows (padded to that run's longest), and each row alone is itself."""
    pads = {"input_ids": 0, "attention_mask": 0}

    def tokenizer(texts: list[str]) -> dict[str, np.ndarray]:
        width = max(len(t) for t in texts)
        return {"input_ids": np.array([[7] * len(t) + [pads["input_ids"]] * (width - len(t)) for t in texts]),
                "attention_mask": np.array([[1] * len(t) + [0] * (width - len(t)) for t in texts])}

    model = ModelInputs((ExpectedInput("input_ids", "INT64", (-1, -1)),
                         ExpectedInput("attention_mask", "INT64", (-1, -1))), tokenizer)
    log = "\n".join(v2_request({"input_ids": np.array([row]), "attention_mask": np.ones((1, len(row)), np.int64)},
                               nested=i % 2 == 0) for i, row in enumerate(rows))
    read = read_request_log(Path("log.jsonl"), log, model)
    assert read.lengths.tolist() == [len(r) for r in rows]
    for i, row in enumerate(rows):
        assert read[i:i + 1].feeds()["input_ids"].tolist() == [row]
    a = cut.draw(st.integers(0, len(rows) - 1))
    b = cut.draw(st.integers(a + 1, len(rows)))
    batch = read[a:b].feeds()
    width = max(len(r) for r in rows[a:b])
    assert batch["input_ids"].tolist() == [r + [0] * (width - len(r)) for r in rows[a:b]]
    assert batch["attention_mask"].tolist() == [[1] * len(r) + [0] * (width - len(r)) for r in rows[a:b]]


@settings(max_examples=50, deadline=None)
@given(keys=st.lists(st.integers(0, 6), min_size=1, max_size=40))
def test_distinct_positions_are_each_inputs_first_in_the_files_order(keys) -> None:
    data = UserData(Path("f.txt"), "txt", [str(k) for k in keys], "")
    positions = data.distinct_positions()
    assert [keys[p] for p in positions] == list(dict.fromkeys(keys))
    assert all(keys.index(keys[p]) == p for p in positions)
    assert [keys[p] for p in data.first_occurrences()] == keys
    rows = UserData(Path("f.npy"), "npy", TensorRows({"x": np.array(keys)[:, None]}), "")
    assert rows.distinct_positions().tolist() == positions.tolist()


@settings(max_examples=50, deadline=None)
@given(n=st.integers(2, 500), fraction=st.sampled_from([0.05, 0.1, 0.25]))
def test_a_tail_split_validates_on_the_last_inputs(n, fraction) -> None:
    train, val = split_indices(n, TrainConfig(val_fraction=fraction, validation="tail"))
    assert np.array_equal(np.concatenate([train, val]), np.arange(n)) and len(val) >= 1
    assert len(val) == max(1, round(n * fraction))


# --- bad data -----------------------------------------------------------------------------------------------------

def refused(model: str, data: Path, tmp_path: Path, *extra: str) -> str:
    """`rampserve prepare MODEL --data DATA` fails, leaving no bundle (nor a half-written one) behind; its message."""
    out = tmp_path / "out" / "bundle"
    result = CliRunner().invoke(app, ["prepare", model, "--data", str(data), "--out", str(out), "--engine",
                                      "onnxruntime" if model.endswith(".onnx") else "torch", *extra])
    assert result.exit_code != 0, result.output
    assert not out.exists() and not (out.parent.exists() and any(out.parent.iterdir()))
    return " ".join(result.output.replace("│", " ").split())  # rich's box, unwrapped


def test_bad_tensor_files_are_refused_by_name_and_leave_nothing_behind(digits, tmp_path) -> None:
    path, images = digits
    onnx = str(path)
    npz = tmp_path / "named.npz"
    np.savez(npz, pixels=images)
    message = refused(onnx, npz, tmp_path)
    assert "the model's inputs are ['image'], the file holds ['pixels']" in message
    assert "missing ['image']" in message and "not the model's ['pixels']" in message

    float64 = tmp_path / "float64.npy"
    np.save(float64, images.astype(np.float64))
    message = refused(onnx, float64, tmp_path)
    assert "input 'image': expected datatype FP32" in message and "got FP64 (float64)" in message

    flat = tmp_path / "flat.npy"
    np.save(flat, images.reshape(len(images), -1))
    message = refused(onnx, flat, tmp_path)
    assert "input 'image': expected shape [-1, 1, 16, 16]" in message and "got [1797, 256]" in message

    few = tmp_path / "few.npy"
    np.save(few, images[:499])
    message = refused(onnx, few, tmp_path)
    assert min_own_inputs(PrepareConfig()) == 500
    assert "ramps need at least 500 distinct inputs to learn from, and its 499 rows hold 499" in message

    repeated = tmp_path / "repeated.npy"
    np.save(repeated, np.concatenate([images[:400]] * 4))
    assert "and its 1600 rows hold 400" in refused(onnx, repeated, tmp_path)
    assert "and its first 1200 rows (--bootstrap) hold 400" in refused(onnx, repeated, tmp_path, "--bootstrap", "1200")

    nan = tmp_path / "nan.npy"
    broken = images.copy()
    broken[5, 0, 3, 3] = np.nan
    np.save(nan, broken)
    assert "input 'image' holds NaN or infinity (row 5)" in refused(onnx, nan, tmp_path)

    damaged = tmp_path / "damaged.npy"
    damaged.write_bytes(b"\x93NUMPY not really")
    assert f"{damaged} cannot be read as .npy" in refused(onnx, damaged, tmp_path)

    unknown = tmp_path / "digits.parquet"
    unknown.write_bytes(b"PAR1")
    assert "unknown data format '.parquet'" in refused(onnx, unknown, tmp_path)
    assert "does not exist" in refused(onnx, tmp_path / "nowhere.npy", tmp_path)

    texts = tmp_path / "texts.txt"
    texts.write_text("a digit\n" * 5)
    assert "holds texts, and the model has no tokenizer" in refused(onnx, texts, tmp_path)


def test_bad_texts_and_request_logs_are_refused_by_line_and_leave_nothing_behind(text_model, sentences,
                                                                                  tmp_path) -> None:
    model = f"hf:{text_model}"
    ids = tmp_path / "ids.npy"
    np.save(ids, np.ones((1200, 8), np.int64))
    assert "a .npy file holds one array, and the model takes 2 inputs ['input_ids', 'attention_mask']" in \
        refused(model, ids, tmp_path)

    jsonl = tmp_path / "texts.jsonl"
    jsonl.write_text("\n".join(json.dumps({"review": s}) for s in sentences))
    assert "line 1: expected an object with a 'text' field (give another with --data-field), got ['review']" in \
        refused(model, jsonl, tmp_path)
    csv = tmp_path / "texts.csv"
    csv.write_text("id,review\n1,fine\n")
    assert "no column 'text' (its columns: ['id', 'review'])" in refused(model, csv, tmp_path)
    assert "ramps need at least 500 distinct inputs to learn from, and its 1 rows hold 1" in \
        refused(model, csv, tmp_path, "--data-field", "review")

    encode = text_encoder(text_model)
    good = [v2_request(encode([s]), nested=False) for s in sentences[:5]]
    cases = {
        "{not json": "line 3 is not JSON",
        json.dumps({"inputs": []}): "line 3: expected a v2 infer request body",
        json.dumps({"inputs": [{"name": "input_ids", "shape": [1, 2], "datatype": "INT64", "data": [1, 2]}]}):
            "line 3: the model's inputs are ['input_ids', 'attention_mask'] (or one BYTES tensor of texts), the "
            "request has ['input_ids']",
        v2_request({"input_ids": np.ones((1, 4), np.float32), "attention_mask": np.ones((1, 4), np.int64)}, True):
            "line 3: input 'input_ids': expected datatype INT64, got FP32",
        json.dumps({"inputs": [{"name": n, "shape": [1, 4], "datatype": "INT64", "data": [1, 2, 3]}
                               for n in ("input_ids", "attention_mask")]}):
            "line 3: input 'input_ids': shape [1, 4] holds 4 values, data has 3",
        json.dumps({"inputs": [{"name": n, "shape": [1, 2], "datatype": "INT64", "data": [1.5, 2]}
                               for n in ("input_ids", "attention_mask")]}):
            "line 3: input 'input_ids': INT64 data must be integers, got float64",
        json.dumps({"inputs": [{"name": "text", "shape": [2], "datatype": "BYTES", "data": ["one"]}]}):
            "line 3: input 'text': a BYTES tensor of texts has shape [n] or [n, 1] and n texts, got shape [2] and "
            "1 values",
    }
    log = tmp_path / "requests.jsonl"
    for line, expected in cases.items():
        log.write_text("\n".join([*good[:2], line, *good[2:]]))
        assert expected in refused(model, log, tmp_path), line


def test_own_data_and_a_workload_are_one_or_the_other(digits, tmp_path) -> None:
    path, images = digits
    data = tmp_path / "d.npy"
    np.save(data, images)
    for extra in ((), ("--data", str(data), "--workload", "fmnist-drift")):
        out = tmp_path / "b"
        result = CliRunner().invoke(app, ["prepare", str(path), "--out", str(out), *extra])
        assert result.exit_code != 0 and "either your own (--data FILE) or a benchmark stream" in \
            " ".join(result.output.replace("│", " ").split())
        assert not out.exists()


def test_images_need_a_size_and_a_layout_they_can_be_given(tmp_path) -> None:
    from PIL import Image

    folder = tmp_path / "images"
    folder.mkdir()
    Image.fromarray(digit_pixels()[0]).save(folder / "0.png")
    free = ModelInputs((ExpectedInput("image", "FP32", (-1, 3, -1, -1)),))
    with pytest.raises(DataError, match=r"size images are resized to is unknown.*give --image-size HxW"):
        read_user_data(folder, free)
    with pytest.raises(DataError, match="image layout 'chw': give nchw or nhwc"):
        read_user_data(folder, free, DataOptions(image=ImageOptions(layout="chw", size=(16, 16))))
    given = read_user_data(folder, free, DataOptions(image=ImageOptions(size=(8, 12), mean=(0.5,), std=(0.25,))))
    assert given.items.arrays["image"].shape == (1, 3, 8, 12)  # RGB, channels first, as the input's shape says
    assert given.preprocessing["mean"] == [0.5] and given.preprocessing["std"] == [0.25]


# --- the benches on one's own inputs ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def digits_twice(digits, tmp_path_factory) -> Path:
    """3,594 distinct inputs in a file: the digits, then each moved a pixel to the right."""
    _, images = digits
    data = tmp_path_factory.mktemp("digits-data") / "digits-twice.npy"
    np.save(data, np.concatenate([images, np.roll(images, 1, axis=3)]))
    return data


def test_bench_sim_replays_the_rows_after_those_the_ramps_learnt_from(digits, digits_twice, own_config) -> None:
    from rampserve.bench.sim import SimSettings, run_sim
    from rampserve.control.controller import ControllerSettings

    path, _ = digits
    rows = np.load(digits_twice)
    config = replace(own_config, engine="onnxruntime", bootstrap_items=8000)
    result = run_sim(SimSettings(model=str(path), data=digits_twice, prepare=config, trace="poisson",
                                 saturation=False, risk_step_sweep=(), controller=ControllerSettings(ramp_budget=0.1)))
    report = result.report
    own = report["data"]
    # at most half the file's rows train the ramps, as `prepare --data F --bootstrap 1797` trains them
    assert own["bootstrap_inputs"] == len(rows) // 2 == own["bootstrap_rows"]
    assert report["workload"] == "data:digits-twice.npy" and own["replayed_seen_in_bootstrap"] == 0
    meta = load_bundle(Path(report["bundle"])).meta
    assert meta["data"]["bootstrap_rows"] == own["bootstrap_rows"] and meta["data"]["sha256"] == own["sha256"]
    assert meta["training"]["num_train"] + meta["training"]["num_val"] == own["bootstrap_inputs"]
    # the replay is every row after them, in the file's order, scored against the model's own answers
    assert report["requests"] == own["replayed_rows"] == len(rows) - own["bootstrap_rows"]
    np.testing.assert_array_equal(result.scenario.outputs.final, onnx_labels(path, rows[own["bootstrap_rows"]:]))
    systems = report["systems"]
    assert systems["vanilla"]["accuracy"] == 1.0 and systems["oracle"]["exit_share"] > 0.5
    assert systems["rampserve"]["accuracy"] >= 0.98


def test_bench_live_plans_its_replay_on_the_file_and_serves_the_bundle_prepared_on_it(text_model, sentences,
                                                                                      own_config, tmp_path) -> None:
    """What `bench live --data` serves and replays, without starting servers: the replays simulated."""
    from rampserve.bench.live import LiveSettings, plan_live, simulate_replays

    texts = tmp_path / "texts.jsonl"
    repeated = sentences + sentences[:300]  # traffic repeats itself
    texts.write_text("\n".join(json.dumps({"text": s}) for s in repeated))
    settings = LiveSettings(model=f"hf:{text_model}", data=texts, prepare=replace(own_config, bootstrap_items=1000),
                            rate_rps=50.0, duration_s=4.0, warmup_requests=20)
    plan = plan_live(settings)
    assert plan.served == str(plan.bundle) and plan.name == plan.bundle.name
    assert plan.first == plan.data["bootstrap_rows"] == 1000 and plan.stream.task == "text"
    assert plan.data["replayed_rows"] == len(repeated) - 1000
    assert plan.data["replayed_seen_in_bootstrap"] == 300  # the repeats at the end learnt from, counted
    assert plan.stream.items(plan.first, plan.first + 2) == repeated[1000:1002]
    report = simulate_replays(replace(settings, seed=3), 1, tmp_path / "replays.json", progress=False)
    assert report["workload"] == "data:texts.jsonl" and report["seeds"][0]["rampserve"]["accuracy"] >= 0.9
    assert [run["seed"] for run in report["seeds"]] == [3]  # the replays start at the seed asked for
