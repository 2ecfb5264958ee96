"""Text in, for a text model: a bundle prepared from `hf:DIR` (a small BERT over MiniLM's vocabulary, saved by the test
and deleted once prepared: the bundle carries its tokenizer) takes its input as one v2 BYTES tensor `text` as well as
token ids, over HTTP (JSON and the binary extension) and gRPC, on a real server on loopback. The text is tokenized in the front end, before the prediction cache: a text and its ids share a
cache entry. Bad text input gets a 400 (INVALID_ARGUMENT) naming what is wrong, and the server serves on."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from functools import cache
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from hypothesis import given, settings
from hypothesis import strategies as st
from test_hf_prepare import random_classifier
from test_serving import get_json, post
from tokenizers import Tokenizer
from transformers import PreTrainedModel

from rampserve.bundle_format.manifest import MANIFEST, TEXT_TOKENIZER_FILE, read_manifest, read_signature
from rampserve.bundle_format.text import TextEncoder
from rampserve.runtime.bundle import save_bundle, write_signature
from rampserve.runtime.prepare import model_encoder, prepare
from rampserve.runtime.sources import ModelSource
from rampserve.serving.executor.loading import load_served
from rampserve.serving.server import ServerSettings, build_state, running_server
from rampserve.serving.shared.protocol import ProtocolError, TensorSpec, parse_infer_request
from rampserve.serving.shared.settings import ModelSettings
from rampserve.zoo import hf_encoders
from rampserve.zoo.minilm import encode_texts
from rampserve.zoo.minilm import model_dir as minilm_dir

MODEL = "my-bert"
TEXTS = ["a wonderful film", "not good at all, sadly, and far too long for what it has to say " * 4, "fine", ""]
TOKEN_IDS = ["input_ids", "attention_mask"]
BOTH = [triton_http.InferRequestedOutput("label"), triton_http.InferRequestedOutput("logits")]


def save_text_classifier(directory: Path) -> PreTrainedModel:
    """A small random BERT over MiniLM's vocabulary whose labels split TEXTS (a random head alone gives every text
    the same label): a wide head, its bias at the middle of their logit differences."""
    vocab = json.loads((minilm_dir() / hf_encoders.TOKENIZER_FILE).read_text())["model"]["vocab"]
    model = random_classifier("bert", num_labels=2, vocab_size=len(vocab))
    with torch.inference_mode():
        model.classifier.weight.mul_(1000.0)
        logits = model(**{k: torch.from_numpy(v) for k, v in encode_texts(TEXTS).items()}).logits
        margins = torch.sort(logits[:, 0] - logits[:, 1]).values
        model.classifier.bias[0] -= (margins[1] + margins[2]) / 2
    model.save_pretrained(directory)
    shutil.copyfile(minilm_dir() / hf_encoders.TOKENIZER_FILE, directory / hf_encoders.TOKENIZER_FILE)
    return model


@pytest.fixture(scope="module")
def text_model(small_prepare_config, tmp_path_factory) -> tuple[Path, TextEncoder, torch.nn.Module]:
    """The bundle, the checkpoint's tokenizer as prepare used it, and the original transformers model."""
    root = tmp_path_factory.mktemp("text")
    checkpoint = root / "checkpoint"
    model = save_text_classifier(checkpoint)
    encoder = hf_encoders.text_encoder(checkpoint)
    config = replace(small_prepare_config, bootstrap_items=300, profile_batch_sizes=(1, 2), profile_repeats=1)
    bundle = save_bundle(prepare(ModelSource.parse(f"hf:{checkpoint}"), config), root / MODEL)
    shutil.rmtree(checkpoint)  # the bundle carries the tokenizer
    return bundle, encoder, model


@pytest.fixture(scope="module")
def server(text_model) -> Iterator[tuple[str, str]]:
    """The server `rampserve serve BUNDLE` runs, with its prediction cache on and gRPC beside HTTP: (HTTP URL, gRPC
    address). The bundle's executor runs in the server's process (one of its own takes seconds to start, and the
    texts are read before a request reaches it; the front end's imports are checked on its own below)."""
    server_settings = ServerSettings(port=0, grpc_port=0, cache_mb=4.0)
    state = build_state([load_served(str(text_model[0]))], ModelSettings(executor="thread", torchscript=False),
                        server_settings)
    with running_server(state, server_settings) as url:
        yield url, f"127.0.0.1:{state.grpc.port}"


def original_logits(text_model, texts: list[str]) -> np.ndarray:
    _, encoder, model = text_model
    with torch.inference_mode():
        return model(**{k: torch.from_numpy(v) for k, v in encoder(texts).items()}).logits.numpy()


def http_text(texts: list[str], binary: bool, shape: list[int] | None = None) -> triton_http.InferInput:
    tensor = triton_http.InferInput("text", shape or [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array(texts, dtype=object).reshape(shape or [len(texts)]), binary_data=binary)
    return tensor


def http_ids(feeds: dict[str, np.ndarray]) -> list[triton_http.InferInput]:
    inputs = []
    for name, array in feeds.items():
        tensor = triton_http.InferInput(name, list(array.shape), "INT64")
        tensor.set_data_from_numpy(array, binary_data=True)
        inputs.append(tensor)
    return inputs


def grpc_text(texts: list[str], shape: list[int]) -> triton_grpc.InferInput:
    tensor = triton_grpc.InferInput("text", shape, "BYTES")
    tensor.set_data_from_numpy(np.array(texts, dtype=object).reshape(shape))
    return tensor


def grpc_ids(feeds: dict[str, np.ndarray]) -> list[triton_grpc.InferInput]:
    inputs = []
    for name, array in feeds.items():
        tensor = triton_grpc.InferInput(name, list(array.shape), "INT64")
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def infer_json(url: str, body: dict) -> tuple[int, dict]:
    code, _, answer = post(f"{url}/v2/models/{MODEL}/infer", json.dumps(body).encode())
    return code, answer


# ---- the tokenizer ----------------------------------------------------------------------------------------------

text_batches = st.lists(st.text(st.characters(blacklist_categories=("Cs",)), max_size=300), min_size=1, max_size=6)


@cache
def both_tokenizers(pad_id: int, max_length: int) -> tuple[TextEncoder, Tokenizer]:
    """MiniLM's tokenizer as a TextEncoder and as the library pads a batch itself."""
    library = Tokenizer.from_file(str(minilm_dir() / "tokenizer.json"))
    library.enable_padding(pad_id=pad_id, pad_token=library.id_to_token(pad_id))
    library.enable_truncation(max_length=max_length)
    return TextEncoder.from_file(minilm_dir() / "tokenizer.json", pad_id, max_length), library


@settings(max_examples=50, deadline=None)
@given(batch=text_batches, pad_id=st.sampled_from([0, 1]), max_length=st.sampled_from([8, 64]))
def test_each_text_alone_then_padded_gives_what_the_tokenizer_pads_as_a_batch(batch, pad_id, max_length) -> None:
    """The front end tokenizes each text alone (the library pads on a thread pool) and pads the batch itself: the
    same ids and mask as the library's own padding to the batch's longest."""
    encoder, library = both_tokenizers(pad_id, max_length)
    ours = encoder(batch)
    encodings = library.encode_batch(batch)
    assert ours["input_ids"].dtype == ours["attention_mask"].dtype == np.int64
    np.testing.assert_array_equal(ours["input_ids"], np.array([e.ids for e in encodings]).reshape(len(batch), -1))
    np.testing.assert_array_equal(ours["attention_mask"],
                                  np.array([e.attention_mask for e in encodings]).reshape(len(batch), -1))


def test_minilm_and_a_text_model_outside_the_zoo_prepare_with_a_tokenizer_a_bundle_can_keep() -> None:
    for source in (ModelSource("zoo", "minilm-rt"), ModelSource("zoo", "minilm-rt", small=True), None):
        encoder = model_encoder(source, "text")
        assert isinstance(encoder, TextEncoder) and encoder.max_length == hf_encoders.MAX_LENGTH
        kept = TextEncoder.from_json(encoder.to_json(), encoder.tokenizer.to_str())
        for key, array in encode_texts(TEXTS).items():
            np.testing.assert_array_equal(kept(TEXTS)[key], array)


# ---- the protocol -----------------------------------------------------------------------------------------------

IDS_SPECS = [TensorSpec(name, "INT64", (-1, -1)) for name in TOKEN_IDS]
TEXT_SPEC = TensorSpec("text", "BYTES", (-1,), column=True)


def parsed(*tensors: dict) -> dict[str, np.ndarray]:
    body = json.dumps({"inputs": list(tensors)}).encode()
    return parse_infer_request(body, None, IDS_SPECS, alternative=[TEXT_SPEC]).inputs


def test_a_request_gives_the_token_ids_or_the_texts_in_their_place() -> None:
    ids = [{"name": name, "datatype": "INT64", "shape": [1, 2], "data": [1, 2]} for name in TOKEN_IDS]
    assert list(parsed(*ids)) == TOKEN_IDS
    flat = parsed({"name": "text", "datatype": "BYTES", "shape": [2], "data": ["é", "b"]})["text"]
    column = parsed({"name": "text", "datatype": "BYTES", "shape": [2, 1], "data": ["é", "b"]})["text"]
    assert flat.shape == (2,) and column.shape == (2, 1) and list(column.ravel()) == ["é".encode(), b"b"]
    with pytest.raises(ProtocolError, match=r"inputs \['text'\] take the place of \['input_ids', 'attention_mask'\]: "
                                            r"give one or the other, not both"):
        parsed({"name": "text", "datatype": "BYTES", "shape": [2], "data": ["a", "b"]}, *ids)
    with pytest.raises(ProtocolError, match=r"unknown input 'txt'; the model's inputs are \['input_ids', "
                                            r"'attention_mask'\], or \['text'\] in their place"):
        parsed({"name": "txt", "datatype": "BYTES", "shape": [1], "data": ["a"]})
    with pytest.raises(ProtocolError, match=r"missing inputs \['attention_mask'\]"):
        parsed(ids[0])
    with pytest.raises(ProtocolError, match=r"input 'text': expected shape \[-1\] or \[-1, 1\] \(-1: any size\), "
                                            r"got \[1, 2\]"):
        parsed({"name": "text", "datatype": "BYTES", "shape": [1, 2], "data": ["a", "b"]})
    with pytest.raises(ProtocolError, match=r"input 'x': expected shape \[-1, 2\] \(-1: any size\), got \[2, 2, 1\]"):
        parse_infer_request(json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 2, 1],
                                                    "data": [1, 2, 3, 4]}]}).encode(), None,
                            [TensorSpec("x", "FP32", (-1, 2))])


# ---- the bundle ---------------------------------------------------------------------------------------------------


def test_the_bundle_keeps_the_tokenizer_as_prepare_used_it(text_model) -> None:
    bundle, encoder, _ = text_model
    served = load_served(str(bundle))
    assert [spec.name for spec in served.inputs] == TOKEN_IDS
    assert TEXT_TOKENIZER_FILE in read_manifest(bundle)["files"]
    carried = served.text.token_inputs(np.array([text.encode() for text in TEXTS], dtype=object))
    for key, array in encoder(TEXTS).items():
        np.testing.assert_array_equal(carried[key], array)


def test_a_bundle_prepared_before_bundles_kept_the_tokenizer_is_given_it_in_place(text_model, tmp_path) -> None:
    """What the zoo's bundle cache does to a text model's bundle from before (`zoo_bundles.zoo_bundle`)."""
    old = shutil.copytree(text_model[0], tmp_path / "old")
    manifest = read_manifest(old)
    del manifest["signature"]["text"], manifest["files"][TEXT_TOKENIZER_FILE]
    (old / TEXT_TOKENIZER_FILE).unlink()
    (old / MANIFEST).write_text(json.dumps(manifest))
    assert load_served(str(old)).text is None
    example_digest = manifest["files"]["example.safetensors"]
    signature = read_signature(old, manifest)
    write_signature(old, replace(signature, text=model_encoder(ModelSource("hf", "moved-away"), "text", old)))
    assert read_manifest(old)["files"]["example.safetensors"] == example_digest  # compiled paths stay valid
    assert load_served(str(old)).text.encoder.max_length == hf_encoders.MAX_LENGTH


def test_serving_a_text_bundle_loads_neither_torch_nor_onnxruntime_in_the_front_end(text_model) -> None:
    script = f"""
import json, sys
from rampserve.serving.shared.settings import ModelSettings
from rampserve.serving.executor.loading import load_served
from rampserve.serving.server import ServerSettings, build_state

served = load_served({str(text_model[0])!r})
build_state([served], ModelSettings(), ServerSettings(port=0, grpc=False))
served.text.token_inputs(__import__("numpy").array([b"a fine film"], dtype=object))
print(json.dumps([name for name in ("torch", "onnxruntime", "transformers") if name in sys.modules]))
"""
    found = subprocess.run([sys.executable, "-c", script], check=True, stdout=subprocess.PIPE, text=True)
    assert json.loads(found.stdout.splitlines()[-1]) == []


# ---- the server ---------------------------------------------------------------------------------------------------


def test_the_metadata_lists_the_text_as_an_alternative_to_the_token_ids(server) -> None:
    url, address = server
    metadata = get_json(f"{url}/v2/models/{MODEL}")
    assert [tensor["name"] for tensor in metadata["inputs"]] == TOKEN_IDS
    assert metadata["parameters"]["alternative_inputs"] == [
        {"name": "text", "datatype": "BYTES", "shape": [-1],
         "parameters": {"content_type": "str", "max_tokens": hf_encoders.MAX_LENGTH}}]
    grpc_metadata = triton_grpc.InferenceServerClient(address).get_model_metadata(MODEL)
    assert [tensor.name for tensor in grpc_metadata.inputs] == TOKEN_IDS  # its message has no parameters


def test_a_text_gets_the_label_of_its_token_ids_over_http_and_grpc(text_model, server) -> None:
    """Each transport and encoding on texts of its own (so none is answered from the cache): the label and logits of
    the original transformers model on the tokenizer's ids, and those of the same ids sent as ids."""
    url, address = server
    expected = original_logits(text_model, TEXTS)
    assert len(set(expected.argmax(axis=1))) > 1  # labels that could differ
    http = triton_http.InferenceServerClient(url.removeprefix("http://"))
    grpc_client = triton_grpc.InferenceServerClient(address)
    grpc_both = [triton_grpc.InferRequestedOutput("label"), triton_grpc.InferRequestedOutput("logits")]
    answers = {
        "json": http.infer(MODEL, [http_text(TEXTS, binary=False)], outputs=BOTH),
        "binary": http.infer(MODEL, [http_text([t + " ." for t in TEXTS], binary=True)], outputs=BOTH),
        "grpc [n]": grpc_client.infer(MODEL, [grpc_text([t + " !" for t in TEXTS], [len(TEXTS)])], outputs=grpc_both),
        "grpc [n, 1]": grpc_client.infer(MODEL, [grpc_text([t + " ?" for t in TEXTS], [len(TEXTS), 1])],
                                         outputs=grpc_both),
    }
    suffixes = {"json": "", "binary": " .", "grpc [n]": " !", "grpc [n, 1]": " ?"}
    _, encoder, _ = text_model
    for how, answer in answers.items():
        sent = [t + suffixes[how] for t in TEXTS]
        reference = original_logits(text_model, sent)
        np.testing.assert_allclose(answer.as_numpy("logits"), reference, rtol=1e-4, atol=1e-5, err_msg=how)
        np.testing.assert_array_equal(answer.as_numpy("label"), reference.argmax(axis=1), err_msg=how)
        ids_client = http if how in ("json", "binary") else grpc_client
        as_ids = ids_client.infer(MODEL, (http_ids if ids_client is http else grpc_ids)(encoder(sent)),
                                  outputs=BOTH if ids_client is http else grpc_both)
        np.testing.assert_array_equal(as_ids.as_numpy("label"), answer.as_numpy("label"), err_msg=how)
        np.testing.assert_array_equal(as_ids.as_numpy("logits"), answer.as_numpy("logits"), err_msg=how)
    np.testing.assert_allclose(answers["json"].as_numpy("logits"), expected, rtol=1e-4, atol=1e-5)


def test_a_text_after_its_token_ids_is_answered_from_the_prediction_cache(text_model, server) -> None:
    url, address = server
    texts = ["the cache keeps the final answer", "of the token ids"]
    ids = {name: array.tolist() for name, array in text_model[1](texts).items()}
    by_ids = {"inputs": [{"name": name, "datatype": "INT64", "shape": [2, len(ids[name][0])],
                          "data": ids[name]} for name in TOKEN_IDS],
              "outputs": [{"name": "label"}, {"name": "logits"}]}
    code, first = infer_json(url, by_ids)
    assert code == 200 and not first["parameters"].get("cached")
    code, by_text = infer_json(url, {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2], "data": texts}],
                                     "outputs": [{"name": "label"}, {"name": "logits"}]})
    assert code == 200 and by_text["parameters"]["cached"] is True
    assert by_text["outputs"] == first["outputs"]
    # and over gRPC, the other way round: ids after their text
    grpc_client = triton_grpc.InferenceServerClient(address)
    more = ["a text first", "then its ids"]
    grpc_client.infer(MODEL, [grpc_text(more, [2])])
    again = grpc_client.infer(MODEL, grpc_ids(text_model[1](more)))
    assert again.get_response(as_json=True)["parameters"]["cached"]["bool_param"] is True
    status = get_json(f"{url}/status")["models"][MODEL]
    assert status["answers"]["cached"] >= 4  # the controller's books count the cache's answers, rows by rows


def binary_body(name: str, datatype: str, shape: list[int], raw: bytes) -> tuple[bytes, dict[str, str]]:
    head = json.dumps({"inputs": [{"name": name, "datatype": datatype, "shape": shape,
                                   "parameters": {"binary_data_size": len(raw)}}]}).encode()
    return head + raw, {"Inference-Header-Content-Length": str(len(head))}


def test_bad_text_input_gets_a_400_that_says_what_is_wrong_and_the_server_serves_on(text_model, server) -> None:
    url, address = server
    not_utf8 = b"\x04\x00\x00\x00fine" + b"\x02\x00\x00\x00\xff\xfe"
    ids = [{"name": name, "datatype": "INT64", "shape": [1, 3], "data": [101, 2204, 102]} for name in TOKEN_IDS]
    bad_json = {
        "expected datatype BYTES, got INT64": [{"name": "text", "datatype": "INT64", "shape": [1], "data": [3]}],
        "the batch dimension is 0": [{"name": "text", "datatype": "BYTES", "shape": [0], "data": []}],
        "give one or the other, not both": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["a"]}, *ids],
        r"expected shape [-1] or [-1, 1]": [{"name": "text", "datatype": "BYTES", "shape": [1, 2],
                                             "data": ["a", "b"]}],
        "BYTES data must be strings": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": [7]}],
    }
    for message, inputs in bad_json.items():
        code, answer = infer_json(url, {"inputs": inputs})
        assert code == 400 and message in answer["error"], (message, answer)
    body, headers = binary_body("text", "BYTES", [2], not_utf8)
    code, _, answer = post(f"{url}/v2/models/{MODEL}/infer", body, headers)
    assert code == 400 and answer["error"] == "input 'text': text 1 is not UTF-8 (invalid start byte at byte 0)"

    grpc_client = triton_grpc.InferenceServerClient(address)
    cases = {"text 1 is not UTF-8": [grpc_text(["fine", "x"], [2])],
             "give one or the other, not both": [grpc_text(["a"], [1]), *grpc_ids(text_model[1](["a"]))]}
    cases["text 1 is not UTF-8"][0]._raw_content = not_utf8  # tritonclient encodes only valid text
    for message, inputs in cases.items():
        with pytest.raises(triton_grpc.InferenceServerException) as refused:
            grpc_client.infer(MODEL, inputs)
        assert refused.value.status() == str(grpc.StatusCode.INVALID_ARGUMENT) and message in refused.value.message()

    good = ["still serving"]
    expected = original_logits(text_model, good).argmax(axis=1)
    code, answer = infer_json(url, {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": good}],
                                    "outputs": [{"name": "label"}, {"name": "logits"}]})
    assert code == 200 and answer["outputs"][0]["data"] == expected.tolist()
    label = grpc_client.infer(MODEL, [grpc_text(good, [1])], outputs=[triton_grpc.InferRequestedOutput("logits"),
                                                                       triton_grpc.InferRequestedOutput("label")])
    np.testing.assert_array_equal(label.as_numpy("label"), expected)
    with urllib.request.urlopen(f"{url}/v2/models/{MODEL}/ready") as ready:
        assert ready.status == 200
