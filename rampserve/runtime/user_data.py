"""A user's own inputs, unlabeled: what `rampserve prepare MODEL --data PATH` trains ramps on (ramps learn the
model's own answers, so no labels are needed) and what `bench sim` / `bench live --data PATH` replay.

By the path's suffix:
- `.npy`: one array whose rows are the inputs of a model with one input;
- `.npz`, `.safetensors`: one array per model input, by the model's input names;
- `.txt` (a text per line), `.jsonl` (a `text` field per line, or another), `.csv` (a column): texts for a text
  model, which its own tokenizer turns into its inputs;
- `.jsonl` whose lines are KServe v2 infer request bodies, `{"inputs": [{"name", "shape", "datatype", "data"}]}`
  exactly as POSTed to `/v2/models/{m}/infer` (data flat or nested; a text model's requests may bring a BYTES
  tensor of texts): the request log a server records;
- a folder of PNG/JPEG files (in file-name order): images for an image model, preprocessed as a Hugging Face
  `preprocessor_config.json` beside the model says, else as the options say.

Reading is pure: a path and the model's inputs in, arrays or texts out, nothing written. Every refusal is a
`DataError` naming the file (and line or input), what the model expects and what came.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rampserve.bundle_format.signature import ANY_SIZE, V2_DATATYPES

TEXT = "text"  # the items are texts, which the model's tokenizer encodes
TENSORS = "tensors"  # the items are `TensorRows`: the model's inputs already
TEXT_FIELD = "text"  # the JSONL field or CSV column of texts unless told otherwise
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
PREPROCESSOR_CONFIG = "preprocessor_config.json"  # a Hugging Face image processor's settings
DATATYPE_OF_NAME = {name: dtype for dtype, name in V2_DATATYPES.items()}
# Which JSON values (as numpy reads them) each datatype's kind takes: a float for an INT64 would be truncated
_VALUE_KINDS = {"f": "iuf", "i": "iu", "u": "iu", "b": "b"}
# The texts the tokenizer's own padding is read from: the first is shorter than the second whatever the tokenizer
_PADDING_PROBE = ("a", "a a a a a a a a")

Tokenizer = Callable[[list[str]], dict[str, np.ndarray]]


class DataError(ValueError):
    """Data that the model cannot take, or a file that cannot be read."""


@dataclass(frozen=True)
class ExpectedInput:
    """One of the model's inputs as its file declares it: a v2 datatype and a shape with the rows first (ANY_SIZE:
    any size). A torch module declares neither (None): the data's own are taken, and the model's first run on them
    says whether they fit."""

    name: str
    datatype: str | None
    shape: tuple[int, ...] | None

    def describe(self) -> str:
        shape = "any shape" if self.shape is None else f"shape {list(self.shape)}"
        return f"'{self.name}' ({self.datatype or 'any datatype'}, {shape})"


@dataclass(frozen=True)
class ModelInputs:
    """What data must give the model: its inputs, in its order; for a text model, the tokenizer that turns texts
    into them (the model's own, padding and truncating as it serves); and where a preprocessor_config.json may lie
    beside the model's files."""

    inputs: tuple[ExpectedInput, ...]
    tokenizer: Tokenizer | None = None
    model_dir: Path | None = None

    @property
    def names(self) -> list[str]:
        return [i.name for i in self.inputs]

    def pad_values(self) -> dict[str, int] | None:
        """What the tokenizer pads each input with (None without a tokenizer): read from its own padding of a short
        text beside a longer one, so any tokenizer's pad id (and mask and type ids) is found the same way."""
        if self.tokenizer is None:
            return None
        probe = self.tokenizer(list(_PADDING_PROBE))
        return {name: int(array[0, -1]) for name, array in probe.items()}

    def describe(self) -> str:
        return ", ".join(i.describe() for i in self.inputs)


@dataclass(frozen=True)
class ImageOptions:
    """Image preprocessing the user gives; each one given wins over the model's preprocessor_config.json and over
    what its input's shape says."""

    size: tuple[int, int] | None = None  # (height, width)
    mean: tuple[float, ...] | None = None  # per channel, on pixels scaled to [0, 1]
    std: tuple[float, ...] | None = None
    layout: str | None = None  # "nchw" or "nhwc"
    channels: int | None = None  # 1 (grey) or 3 (RGB)


@dataclass(frozen=True)
class DataOptions:
    text_field: str | None = None  # texts: the JSONL field or CSV column (default "text")
    image: ImageOptions = field(default_factory=ImageOptions)
    # Images: this preprocessing as it is (what a bundle recorded), instead of one found from `image` and the model
    preprocessing: Preprocessing | None = None


@dataclass(frozen=True)
class TensorRows:
    """Inputs as the model takes them: one array per input, in the model's input order, rows first. A text model's
    token rows of different lengths share their arrays padded to the longest with the tokenizer's own padding, and
    `lengths` keeps each row's positions before its padding: a batch of rows is cut to its longest, as the
    tokenizer pads a batch (the model's answers do not depend on padding it masks)."""

    arrays: Mapping[str, np.ndarray]
    lengths: np.ndarray | None = None

    def __len__(self) -> int:
        return len(next(iter(self.arrays.values())))

    def __getitem__(self, rows: slice | np.ndarray | Sequence[int]) -> TensorRows:
        return TensorRows({name: array[rows] for name, array in self.arrays.items()},
                          None if self.lengths is None else self.lengths[rows])

    def feeds(self) -> dict[str, np.ndarray]:
        """The rows as one batch of model inputs."""
        if self.lengths is None or not len(self):
            return dict(self.arrays)
        width = int(self.lengths.max())
        return {name: array[:, :width] for name, array in self.arrays.items()}

    def row_keys(self) -> list[bytes]:
        """Per row, bytes that equal rows share and different rows do not."""
        lengths = self.lengths
        return [b"".join((array[i, :lengths[i]] if lengths is not None else array[i]).tobytes()
                         for array in self.arrays.values()) for i in range(len(self))]


def rows_encoder(rows: TensorRows) -> dict[str, np.ndarray]:
    """The encoder of items that are the model's inputs already."""
    return rows.feeds()


@dataclass(frozen=True)
class UserData:
    path: Path
    format: str  # npy, npz, safetensors, txt, jsonl, csv, requests or images
    items: list[str] | TensorRows  # in the file's order
    sha256: str  # of the file's bytes (a folder: of its images' names and bytes)
    preprocessing: dict | None = None  # images: the preprocessing applied, as a record

    @property
    def kind(self) -> str:
        return TEXT if isinstance(self.items, list) else TENSORS

    def __len__(self) -> int:
        return len(self.items)

    def distinct_positions(self) -> np.ndarray:
        """Where each distinct input first comes, in the file's order: a repeated input adds weight to what ramps
        learn, not knowledge, and one both in training and validation would flatter them."""
        keys = self.items if isinstance(self.items, list) else self.items.row_keys()
        first: dict[object, int] = {}
        for position, key in enumerate(keys):
            first.setdefault(key, position)
        return np.fromiter(first.values(), dtype=np.int64, count=len(first))

    def first_occurrences(self) -> np.ndarray:
        """Per position, the position where its input first comes (equal inputs share it)."""
        keys = self.items if isinstance(self.items, list) else self.items.row_keys()
        first: dict[object, int] = {}
        return np.array([first.setdefault(key, position) for position, key in enumerate(keys)], dtype=np.int64)

    def take(self, positions: np.ndarray) -> list[str] | TensorRows:
        if isinstance(self.items, list):
            return [self.items[int(p)] for p in positions]
        return self.items[positions]

    def record(self) -> dict:
        """What a bundle's meta keeps of the data it was prepared on."""
        return {"path": str(self.path), "format": self.format, "sha256": self.sha256, "rows": len(self),
                **({"preprocessing": self.preprocessing} if self.preprocessing else {})}


def read_user_data(path: Path, model: ModelInputs, options: DataOptions = DataOptions()) -> UserData:
    """The inputs in `path` (module docstring), checked against `model`'s."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path} does not exist")
    if path.is_dir():
        rows, preprocessing = read_images(path, model, options)
        return UserData(path, "images", rows, folder_digest(path), preprocessing)
    suffix = path.suffix.lower()
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DataError(f"{path} cannot be read: {exc}") from exc
    digest = hashlib.sha256(raw).hexdigest()
    if suffix in (".npy", ".npz", ".safetensors"):
        return UserData(path, suffix[1:], read_tensor_file(path, raw, model), digest)
    if suffix in (".txt", ".jsonl", ".csv"):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(f"{path} is not UTF-8 text: {exc}") from exc
        if suffix == ".jsonl" and _is_request_log(path, text):
            return UserData(path, "requests", read_request_log(path, text, model), digest)
        texts = read_texts(path, text, options.text_field)
        if model.tokenizer is None:
            raise DataError(f"{path} holds texts, and the model has no tokenizer to turn them into its inputs "
                            f"{model.describe()}: texts need a text model (hf:DIR, or a zoo text model); give this "
                            "model tensors (.npy, .npz, .safetensors) or a request log")
        return UserData(path, suffix[1:], texts, digest)
    raise DataError(f"{path}: unknown data format {path.suffix or '(no suffix)'!r}: give .npy, .npz, .safetensors, "
                    ".txt, .jsonl (texts, or v2 infer requests), .csv, or a folder of PNG/JPEG images")


def folder_digest(folder: Path) -> str:
    h = hashlib.sha256()
    for file in image_files(folder):
        h.update(file.name.encode() + b"\0" + hashlib.sha256(file.read_bytes()).digest())
    return h.hexdigest()


# --- tensors ----------------------------------------------------------------------------------------------------

def read_tensor_file(path: Path, raw: bytes, model: ModelInputs) -> TensorRows:
    """A .npy, .npz or .safetensors file's arrays as the model's inputs. Never unpickles (numpy's object arrays
    are refused)."""
    suffix = path.suffix.lower()
    try:
        if suffix == ".safetensors":
            import safetensors.numpy

            arrays = dict(safetensors.numpy.load(raw))
        else:
            import io

            loaded = np.load(io.BytesIO(raw), allow_pickle=False)
            arrays = {name: loaded[name] for name in loaded.files} if suffix == ".npz" else {"": loaded}
    except Exception as exc:  # numpy and safetensors raise many kinds for a damaged file
        raise DataError(f"{path} cannot be read as {suffix}: {exc}") from exc
    if suffix == ".npy":
        if len(model.inputs) != 1:
            raise DataError(f"{path}: a .npy file holds one array, and the model takes {len(model.inputs)} inputs "
                            f"{model.names}: give them by name in a .npz or .safetensors file")
        arrays = {model.names[0]: arrays[""]}
    elif sorted(arrays) != sorted(model.names):
        missing = [n for n in model.names if n not in arrays]
        unexpected = [n for n in arrays if n not in model.names]
        raise DataError(f"{path}: the model's inputs are {model.names}, the file holds {sorted(arrays)}"
                        + (f" (missing {missing}" if missing else " (")
                        + (f"{', ' if missing else ''}not the model's {unexpected})" if unexpected else ")"))
    return checked_rows(arrays, model, str(path))


def checked_rows(arrays: Mapping[str, np.ndarray], model: ModelInputs, where: str) -> TensorRows:
    """`arrays` (one per model input) as rows, once each agrees with the model's datatype and shape, all hold the
    same number of rows, and no float is NaN or infinite (the server refuses those too)."""
    for spec in model.inputs:
        check_array(arrays[spec.name], spec, where)
    rows = {name: len(array) for name, array in arrays.items()}
    if len(set(rows.values())) != 1:
        raise DataError(f"{where}: the inputs hold different numbers of rows: {rows}")
    ordered = {name: np.asarray(arrays[name]) for name in model.names}
    return TensorRows(ordered, token_lengths(ordered, model))


def check_array(array: np.ndarray, spec: ExpectedInput, where: str) -> None:
    datatype = V2_DATATYPES.get(array.dtype)
    if datatype is None:
        raise DataError(f"{where}: input '{spec.name}' holds {array.dtype} values, which are no tensor datatype "
                        f"the model takes; expected {spec.datatype or 'numbers'}")
    if spec.datatype is not None and datatype != spec.datatype:
        raise DataError(f"{where}: input '{spec.name}': expected datatype {spec.datatype} "
                        f"({DATATYPE_OF_NAME.get(spec.datatype, spec.datatype)}), got {datatype} ({array.dtype}): "
                        f"convert it (numpy: array.astype(np.{DATATYPE_OF_NAME.get(spec.datatype, 'float32')}))")
    if array.ndim == 0 or len(array) == 0:
        raise DataError(f"{where}: input '{spec.name}' holds no rows (shape {list(array.shape)})")
    if spec.shape is not None and (len(spec.shape) != array.ndim or any(
            want not in (ANY_SIZE, got) for want, got in zip(spec.shape[1:], array.shape[1:]))):
        raise DataError(f"{where}: input '{spec.name}': expected shape {list(spec.shape)} (-1: any size; the first "
                        f"is the rows), got {list(array.shape)}")
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        row = int(np.flatnonzero(~np.isfinite(array.reshape(len(array), -1)).all(axis=1))[0])
        raise DataError(f"{where}: input '{spec.name}' holds NaN or infinity (row {row})")


def token_lengths(arrays: Mapping[str, np.ndarray], model: ModelInputs) -> np.ndarray | None:
    """Per row of a text model's token inputs, its positions before the tokenizer's padding (1 + the last position
    where any input differs from its pad value); None for a model without a tokenizer."""
    pads = model.pad_values()
    if pads is None:
        return None
    real = np.zeros(next(iter(arrays.values())).shape[:2], dtype=bool)
    for name, array in arrays.items():
        real |= array.reshape(*array.shape[:2], -1).__ne__(pads.get(name, 0)).any(axis=2)
    last = real.shape[1] - np.argmax(real[:, ::-1], axis=1)  # 1 + the last real position of each row
    return np.where(real.any(axis=1), last, 1).astype(np.int64)


# --- texts ------------------------------------------------------------------------------------------------------

def read_texts(path: Path, text: str, data_field: str | None) -> list[str]:
    """Texts from a .txt (a text per non-blank line), .jsonl (a field of each line's object) or .csv (a column)."""
    suffix = path.suffix.lower()
    name = data_field or TEXT_FIELD
    if suffix == ".txt":
        if data_field is not None:
            raise DataError(f"{path}: --data-field names a JSONL field or CSV column; a .txt file holds a text per "
                            "line")
        return [line for line in text.splitlines() if line.strip()]
    if suffix == ".csv":
        reader = csv.DictReader(text.splitlines())
        if reader.fieldnames is None or name not in reader.fieldnames:
            raise DataError(f"{path}: no column {name!r} (its columns: {reader.fieldnames or []}): give the column "
                            "of texts with --data-field")
        try:
            return [row[name] for row in reader if (row[name] or "").strip()]
        except csv.Error as exc:
            raise DataError(f"{path} is not valid CSV: {exc}") from exc
    texts = []
    for number, line in _json_lines(path, text):
        if not isinstance(line, dict) or name not in line:
            fields = sorted(line) if isinstance(line, dict) else type(line).__name__
            raise DataError(f"{path} line {number}: expected an object with a {name!r} field (give another with "
                            f"--data-field), got {fields}")
        if not isinstance(line[name], str):
            raise DataError(f"{path} line {number}: field {name!r} must be a string, got "
                            f"{type(line[name]).__name__}")
        texts.append(line[name])
    return texts


def _json_lines(path: Path, text: str) -> Iterator[tuple[int, object]]:
    """(line number, value) of each non-blank line."""
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path} line {number} is not JSON: {exc}") from exc


def _is_request_log(path: Path, text: str) -> bool:
    """Whether a .jsonl file's first line is a v2 infer request (an object with "inputs") rather than a text's."""
    first = next(_json_lines(path, text), None)
    return first is not None and isinstance(first[1], dict) and "inputs" in first[1]


# --- request logs -----------------------------------------------------------------------------------------------

def read_request_log(path: Path, text: str, model: ModelInputs) -> TensorRows:
    """Every row of every request in a JSON-lines log of v2 infer request bodies, in the log's order. A text model's
    requests may bring their texts (one BYTES tensor, shape [n] or [n, 1]) instead of token ids: its tokenizer
    encodes them. Token rows of different lengths are padded with the tokenizer's padding; any other input must
    keep one shape."""
    parts: list[dict[str, np.ndarray] | list[str]] = []
    for number, request in _json_lines(path, text):
        where = f"{path} line {number}"
        if not isinstance(request, dict) or not isinstance(request.get("inputs"), list) or not request["inputs"]:
            raise DataError(f"{where}: expected a v2 infer request body, {{\"inputs\": [{{\"name\", \"shape\", "
                            "\"datatype\", \"data\"}, ...]}")
        parts.append(_request_rows(request["inputs"], model, where))
    if not parts:
        raise DataError(f"{path} holds no requests")
    texts = [t for part in parts if isinstance(part, list) for t in part]
    encoded = model.tokenizer(texts) if texts and model.tokenizer is not None else {}
    start, arrays = 0, []
    for part in parts:
        if isinstance(part, list):
            arrays.append({name: array[start:start + len(part)] for name, array in encoded.items()})
            start += len(part)
        else:
            arrays.append(part)
    return checked_rows(_stacked(arrays, model, path), model, str(path))


def _request_rows(tensors: list, model: ModelInputs, where: str) -> dict[str, np.ndarray] | list[str]:
    """One request's inputs as arrays, or its texts."""
    given: dict[str, dict] = {}
    for position, tensor in enumerate(tensors):
        if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str):
            raise DataError(f"{where}: inputs[{position}] must be an object with a string 'name'")
        if tensor["name"] in given:
            raise DataError(f"{where}: input '{tensor['name']}' appears more than once")
        given[tensor["name"]] = tensor
    if model.tokenizer is not None and len(given) == 1 and next(iter(given.values())).get("datatype") == "BYTES":
        return _request_texts(next(iter(given.values())), where)
    if sorted(given) != sorted(model.names):
        raise DataError(f"{where}: the model's inputs are {model.names}"
                        + (" (or one BYTES tensor of texts)" if model.tokenizer is not None else "")
                        + f", the request has {sorted(given)}")
    return {spec.name: _request_array(given[spec.name], spec, where) for spec in model.inputs}


def _request_shape(tensor: dict, where: str) -> tuple[str, list[int]]:
    name, datatype, shape = tensor["name"], tensor.get("datatype"), tensor.get("shape")
    if not isinstance(datatype, str):
        raise DataError(f"{where}: input '{name}' has no datatype")
    if not isinstance(shape, list) or not shape or not all(type(d) is int and d >= 0 for d in shape):
        raise DataError(f"{where}: input '{name}': shape must be a non-empty list of non-negative integers, got "
                        f"{shape!r}")
    if "data" not in tensor:
        raise DataError(f"{where}: input '{name}' has no 'data' (a log holds JSON data; binary tensors are not "
                        "kept in it)")
    return datatype, shape


def _request_texts(tensor: dict, where: str) -> list[str]:
    _, shape = _request_shape(tensor, where)
    texts = _flatten(tensor["data"])
    if len(shape) > 2 or (len(shape) == 2 and shape[1] != 1) or len(texts) != shape[0]:
        raise DataError(f"{where}: input '{tensor['name']}': a BYTES tensor of texts has shape [n] or [n, 1] and n "
                        f"texts, got shape {shape} and {len(texts)} values")
    if not all(isinstance(t, str) for t in texts):
        raise DataError(f"{where}: input '{tensor['name']}': BYTES data must be strings")
    return texts


def _request_array(tensor: dict, spec: ExpectedInput, where: str) -> np.ndarray:
    datatype, shape = _request_shape(tensor, where)
    if datatype not in DATATYPE_OF_NAME:
        raise DataError(f"{where}: input '{spec.name}': datatype {datatype!r} is not one the model takes "
                        f"({spec.datatype or ', '.join(DATATYPE_OF_NAME)})")
    if spec.datatype is not None and datatype != spec.datatype:
        raise DataError(f"{where}: input '{spec.name}': expected datatype {spec.datatype}, got {datatype}")
    try:
        values = np.asarray(tensor["data"])
    except ValueError as exc:  # nested lists of different lengths
        raise DataError(f"{where}: input '{spec.name}': data is not a (flat or regularly nested) list: {exc}") from exc
    dtype = DATATYPE_OF_NAME[datatype]
    if values.size != math.prod(shape):
        raise DataError(f"{where}: input '{spec.name}': shape {shape} holds {math.prod(shape)} values, data has "
                        f"{values.size}")
    if values.size and values.dtype.kind not in _VALUE_KINDS[dtype.kind]:
        raise DataError(f"{where}: input '{spec.name}': {datatype} data must be "
                        f"{'integers' if dtype.kind in 'iu' else 'numbers' if dtype.kind == 'f' else 'true/false'}, "
                        f"got {values.dtype}")
    return values.astype(dtype).reshape(shape)


def _flatten(data: object) -> list:
    if not isinstance(data, list):
        return [data]
    return [value for item in data for value in _flatten(item)]


def _stacked(parts: list[dict[str, np.ndarray]], model: ModelInputs, path: Path) -> dict[str, np.ndarray]:
    """The requests' rows in one array per input: token rows padded to the longest with the tokenizer's padding."""
    pads = model.pad_values()
    stacked = {}
    for name in model.names:
        arrays = [part[name] for part in parts]
        shapes = {a.shape[1:] for a in arrays}
        if len(shapes) > 1:
            if pads is None or any(len(s) != 1 for s in shapes):
                raise DataError(f"{path}: input '{name}' comes in shapes {sorted(map(list, shapes))} (after the "
                                "rows); only a text model's token rows may differ in length")
            width = max(s[0] for s in shapes)
            arrays = [np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=pads.get(name, 0))
                      for a in arrays]
        stacked[name] = np.concatenate(arrays)
    return stacked


# --- images -----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Preprocessing:
    """How an image becomes a model input, Hugging Face's way: RGB (or grey), resized (the shorter edge to a size
    and a centre crop, or straight to height x width), pixels scaled by `rescale`, normalized by mean and std,
    channels first or last."""

    height: int
    width: int
    channels: int
    layout: str
    mean: tuple[float, ...]
    std: tuple[float, ...]
    rescale: float = 1 / 255
    shortest_edge: int | None = None  # resize the shorter edge to this, then crop the centre to height x width
    resample: int = 2  # PIL's bilinear, Hugging Face's default

    def apply(self, image) -> np.ndarray:
        from PIL import Image

        image = image.convert("L" if self.channels == 1 else "RGB")
        if self.shortest_edge is not None:
            scale = self.shortest_edge / min(image.size)
            image = image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))),
                                 Image.Resampling(self.resample))
            left, top = (image.width - self.width) // 2, (image.height - self.height) // 2
            image = image.crop((left, top, left + self.width, top + self.height))
        else:
            image = image.resize((self.width, self.height), Image.Resampling(self.resample))
        pixels = np.asarray(image, dtype=np.float32).reshape(self.height, self.width, self.channels) * self.rescale
        pixels = (pixels - np.asarray(self.mean, np.float32)) / np.asarray(self.std, np.float32)
        return pixels.transpose(2, 0, 1) if self.layout == "nchw" else pixels

    def to_json(self) -> dict:
        return {"height": self.height, "width": self.width, "channels": self.channels, "layout": self.layout,
                "mean": list(self.mean), "std": list(self.std), "rescale": self.rescale,
                "shortest_edge": self.shortest_edge, "resample": self.resample}

    @classmethod
    def from_json(cls, data: dict) -> Preprocessing:
        return cls(**{**data, "mean": tuple(data["mean"]), "std": tuple(data["std"])})


def image_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def read_images(folder: Path, model: ModelInputs, options: DataOptions) -> tuple[TensorRows, dict]:
    """The folder's PNG/JPEG files, in file-name order, preprocessed into the model's one input."""
    from PIL import Image, UnidentifiedImageError
    from tqdm.auto import tqdm

    files = image_files(folder)
    if not files:
        raise DataError(f"{folder} holds no PNG or JPEG files ({', '.join(IMAGE_SUFFIXES)})")
    if len(model.inputs) != 1:
        raise DataError(f"{folder}: images fill a model's one input, and the model takes {len(model.inputs)}: "
                        f"{model.describe()}")
    spec = model.inputs[0]
    preprocessing = options.preprocessing or image_preprocessing(spec, model.model_dir, options.image, folder)
    images = []
    for file in tqdm(files, desc="reading images", unit="image", leave=False):
        try:
            with Image.open(file) as image:
                images.append(preprocessing.apply(image))
        except (UnidentifiedImageError, OSError, ValueError) as exc:
            raise DataError(f"{file} cannot be read as an image: {exc}") from exc
    dtype = DATATYPE_OF_NAME.get(spec.datatype or "FP32", np.dtype(np.float32))
    if dtype.kind != "f":
        raise DataError(f"{folder}: the model's input {spec.describe()} is not a float tensor an image becomes")
    rows = checked_rows({spec.name: np.stack(images).astype(dtype)}, model, str(folder))
    return rows, preprocessing.to_json()


def image_preprocessing(spec: ExpectedInput, model_dir: Path | None, options: ImageOptions,
                        folder: Path) -> Preprocessing:
    """The preprocessing of images for the input `spec`: each of the options given, else the model's
    preprocessor_config.json's, else what the input's shape says (layout, channels, size), else RGB channels first
    with pixels scaled to [0, 1]."""
    config = _preprocessor_config(model_dir)
    shaped = _shape_layout(spec)
    layout = options.layout or (shaped[0] if shaped else "nchw")
    if layout not in ("nchw", "nhwc"):
        raise DataError(f"image layout {layout!r}: give nchw or nhwc")
    size, shortest_edge = options.size, None
    if size is None and config.get("do_resize", True) and "size" in config:
        size, shortest_edge = _config_size(config, model_dir)
    if size is None and shaped:
        size = shaped[2]
    if size is None:
        raise DataError(f"{folder}: the size images are resized to is unknown: the model's input {spec.describe()} "
                        f"does not fix it and no {PREPROCESSOR_CONFIG} lies beside the model: give --image-size HxW")
    normalize = config.get("do_normalize", "image_mean" in config)
    mean = options.mean or (tuple(config["image_mean"]) if normalize and "image_mean" in config else None)
    std = options.std or (tuple(config["image_std"]) if normalize and "image_std" in config else None)
    channels = options.channels or (shaped[1] if shaped else len(mean) if mean and len(mean) in (1, 3) else 3)
    if channels not in (1, 3):
        raise DataError(f"images have 1 (grey) or 3 (RGB) channels, not {channels}")
    mean, std = mean or (0.0,) * channels, std or (1.0,) * channels
    if len(mean) not in (1, channels) or len(std) not in (1, channels):
        raise DataError(f"image mean {list(mean)} and std {list(std)} need 1 or {channels} values (one per channel)")
    rescale = float(config.get("rescale_factor", 1 / 255)) if config.get("do_rescale", True) else 1.0
    return Preprocessing(size[0], size[1], channels, layout, tuple(map(float, mean)), tuple(map(float, std)),
                         rescale, shortest_edge, int(config.get("resample", 2)))


def _preprocessor_config(model_dir: Path | None) -> dict:
    file = None if model_dir is None else Path(model_dir) / PREPROCESSOR_CONFIG
    if file is None or not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DataError(f"{file} cannot be read as JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise DataError(f"{file} is not a Hugging Face image processor's settings (a JSON object)")
    return config


def _config_size(config: dict, model_dir: Path | None) -> tuple[tuple[int, int], int | None]:
    """((height, width), shortest edge or None) from a preprocessor config's size (and crop)."""
    size = config["size"]
    if isinstance(size, int):
        return (size, size), None
    if isinstance(size, dict) and {"height", "width"} <= set(size):
        return (int(size["height"]), int(size["width"])), None
    if isinstance(size, dict) and "shortest_edge" in size and config.get("do_center_crop"):
        crop = config.get("crop_size", size["shortest_edge"])
        crop = (crop, crop) if isinstance(crop, int) else (int(crop["height"]), int(crop["width"]))
        return crop, int(size["shortest_edge"])
    raise DataError(f"{Path(model_dir or '.') / PREPROCESSOR_CONFIG}: size {size!r} is not one rampserve follows "
                    "(height and width, an int, or a shortest edge with a centre crop): give --image-size HxW")


def _shape_layout(spec: ExpectedInput) -> tuple[str, int, tuple[int, int] | None] | None:
    """(layout, channels, (height, width) or None) as a 4-d input's declared shape says; None if it does not."""
    shape = spec.shape
    if shape is None or len(shape) != 4:
        return None
    if shape[1] in (1, 3) and shape[3] not in (1, 3):
        fixed = shape[2] > 0 and shape[3] > 0
        return "nchw", shape[1], (shape[2], shape[3]) if fixed else None
    if shape[3] in (1, 3):
        fixed = shape[1] > 0 and shape[2] > 0
        return "nhwc", shape[3], (shape[1], shape[2]) if fixed else None
    return None


# --- the model's side -------------------------------------------------------------------------------------------

def onnx_inputs(path: Path) -> tuple[ExpectedInput, ...]:
    """An ONNX model's inputs as its graph declares them (weights listed as inputs left out)."""
    import onnx
    from onnx.helper import tensor_dtype_to_np_dtype

    graph = onnx.load(str(path), load_external_data=False).graph
    weights = {w.name for w in graph.initializer}
    inputs = []
    for value in graph.input:
        if value.name in weights:
            continue
        tensor = value.type.tensor_type
        datatype = V2_DATATYPES.get(np.dtype(tensor_dtype_to_np_dtype(tensor.elem_type)))
        dims = [d.dim_value if d.HasField("dim_value") else ANY_SIZE for d in tensor.shape.dim]
        shape = (ANY_SIZE, *dims[1:]) if tensor.HasField("shape") and dims else None
        inputs.append(ExpectedInput(value.name, datatype, shape))
    return tuple(inputs)


def example_inputs(example: Mapping[str, np.ndarray], variable: bool) -> tuple[ExpectedInput, ...]:
    """The inputs of a model that took `example` (rows first): their datatypes, and their shapes with any number of
    rows (and, where `variable`, any length after them: a text model's token positions)."""
    return tuple(ExpectedInput(name, V2_DATATYPES[array.dtype],
                               (ANY_SIZE, *(ANY_SIZE if variable else d for d in array.shape[1:])))
                 for name, array in example.items())
