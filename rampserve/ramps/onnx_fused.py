"""Linear and MLP ramps fused into ONNX stages: the ramp as ONNX nodes that the session of the stage ending at its site
runs after the stage's own nodes (`graph.onnx_graph.Tap`), its logits and the batch's highest confidence extra
outputs of that session call.

Evaluated in Python instead, a ramp between two sessions converts the activation to a tensor and dispatches
each step of its pooling and head through the interpreter, then scores every row (on resnet18-fmnist at batch 1,
17 us a ramp for the scoring alone: NumPy called between two sessions, with cold caches). Fused, it is a few ONNX
Runtime kernels in the call that computes its site, and Python compares one number with the exit floor; the
logits are scored, as the eager ramp's are, by the releasing thread where some input may exit and after the
answers where none can (as for the torch ramp operator, see `runtime.compiled`).

A linear ramp reading its site in the model's layout is one node of rampserve's own operator (`onnx_kernel`,
the torch operator's arithmetic): as ONNX's operators a masked token mean and its head are fifteen nodes, each
dispatched and, at two intra-op threads, split across ONNX Runtime's pool. MLP ramps and those reading a blocked
layout stay ONNX's operators.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from rampserve.control.scores import ERROR_SCORES
from rampserve.graph.onnx_graph import OperatorLibrary, Tap
from rampserve.ramps import onnx_kernel
from rampserve.ramps.arrays import RampArrays
from rampserve.ramps.kernel_args import POOLED, SCORE_CODES, KernelArgs, takes
from rampserve.ramps.pooling import (
    POOLING_REDUCTIONS,
    TOKEN_REDUCTIONS,
    pooling_matrix,
    sampled,
    sampling_stride,
    separable_pooling,
)
from rampserve.ramps.specs import DENSE_KINDS

if TYPE_CHECKING:
    from rampserve.ramps.kinds import Ramp

# The reductions a tap computes; a ramp with another (a deep head's grid) is evaluated in Python
TAPPED_REDUCTIONS = (*POOLING_REDUCTIONS, "identity", *TOKEN_REDUCTIONS)
# The operator set from which each reduction takes its axes as an input rather than as an attribute
AXES_AS_INPUT_SINCE = {"ReduceSum": 13, "ReduceMean": 18, "ReduceMax": 18}
# A blocked map of at most this many positions is pooled by one MatMul over all of them rather than by rows then by
# columns (two MatMuls and a Reshape between): on a 3 ms model each node a ramp adds costs about 2 us, more than the
# arithmetic the separable pooling saves on a 14x14 map or smaller
JOINT_POOLING_POSITIONS = 14 * 14


def can_tap(ramp: object) -> bool:
    """Whether `ramp` (a ramp module or `RampArrays`) fuses into ONNX stages: a linear or MLP one reducing as a tap
    can."""
    return ramp.spec.kind in DENSE_KINDS and ramp.spec.reduce in TAPPED_REDUCTIONS


def ramp_tap(ramp: RampArrays | Ramp, site: str, activation_shape: tuple[int, ...], opset: int, score: str,
             block: int = 0, use_operator: bool = True) -> Tap:
    """`ramp` (linear or MLP, see `can_tap`) on the cut value `site` of per-input shape `activation_shape`, as ONNX
    nodes for a model of operator set `opset`. Its outputs: logits = (reduce(activation) - center) @ weight.T + bias
    (an MLP's hidden layer so, then its ReLU and output layer), reducing as the eager ramp does (a pooling as a
    matmul by its pooling matrix, as `PooledLinear` computes it), and the highest confidence (1 - error `score`) of
    any row, in float32: to tell whether any input may exit.
    With `block` > 0 the value is in ONNX Runtime's blocked layout (see `graph.onnx_graph.SiteValue`); a pooling
    ramp reads it as it is, its center and weight reordered to match.
    A linear ramp on a value in the model's layout is one node of rampserve's ONNX Runtime operator
    (`onnx_kernel`), where it is built and `use_operator`; else, and for any other, ONNX's own operators."""
    if not can_tap(ramp):
        raise ValueError(f"a {ramp.spec.kind} ramp reducing by {ramp.spec.reduce} is not fused into ONNX stages")
    if block and ramp.spec.reduce not in POOLING_REDUCTIONS:
        raise ValueError(f"a ramp reducing by {ramp.spec.reduce} does not read a blocked layout")
    if score not in ERROR_SCORES:
        raise ValueError(f"unknown error score {score!r}; known: {ERROR_SCORES}")
    prefix = f"ramp[{site}]"
    weights: dict[str, np.ndarray] = {}

    def constant(name: str, value: np.ndarray) -> str:
        weights[f"{prefix}/{name}"] = value
        return f"{prefix}/{name}"

    nodes = []

    def node(op: str, inputs: list[str], output: str = "", **attributes: object) -> str:
        output = output or f"{prefix}/{op}_{len(nodes)}"
        nodes.append(helper.make_node(op, inputs, [output], name=output, **attributes))
        return output

    def over_axis(op: str, value: str, axis: int = 1, keepdims: int = 0) -> str:
        if opset >= AXES_AS_INPUT_SINCE[op]:
            axes = constant(f"{op}_axes{axis}", np.array([axis], dtype=np.int64))
            return node(op, [value, axes], keepdims=keepdims)
        return node(op, [value], axes=[axis], keepdims=keepdims)

    reduce = ramp.spec.reduce
    stride = sampling_stride(activation_shape, reduce)
    if stride > 1:  # the rows and columns pooled, taken first (`pooling.sampled`): the pooling reads no other
        height, width = activation_shape[1:]
        axes = [1, 2] if block else [2, 3]
        if block:  # (n * blocks, height, width, block) in memory
            site = node("Reshape", [site, constant("cells_shape", np.array([-1, height, width, block], np.int64))])
        site = node("Slice", [site, constant("starts", np.zeros(2, np.int64)),
                              constant("ends", np.array([height, width], np.int64)),
                              constant("axes", np.array(axes, np.int64)),
                              constant("steps", np.full(2, stride, np.int64))])
    arrays = ramp.arrays()
    operator = onnx_kernel.library() if use_operator and block == 0 and takes(arrays) else None
    if operator is not None:  # the whole ramp as one node of rampserve's operator
        args = KernelArgs.of(arrays, activation_shape)
        inputs = [site, *(constant(name, getattr(args, name)) for name in ("weight", "bias", "center")),
                  *([constant("pool", args.pool)] if args.reduce == POOLED else [])]
        nodes.append(helper.make_node(onnx_kernel.OP_TYPE, inputs, [f"{prefix}/logits", f"{prefix}/confidence"],
                                      name=f"{prefix}/{onnx_kernel.OP_TYPE}", domain=onnx_kernel.DOMAIN,
                                      reduce=args.reduce, score=SCORE_CODES[score]))
        return _tap(f"{prefix}:{score}:{onnx_kernel.OP_TYPE}", nodes, weights, f"{prefix}/logits",
                    f"{prefix}/confidence", ramp.spec.num_classes, (OperatorLibrary(onnx_kernel.DOMAIN, operator),))
    activation_shape, reduce = sampled(activation_shape, reduce)
    layers, center = arrays.layers, arrays.center.astype(np.float32)
    weight_t = layers[0][0].T.astype(np.float32)
    if block:  # maps pooled in blocks: (n * blocks, cells, block), features by block
        channels, (height, width) = activation_shape[0], activation_shape[1:]
        blocks = -(-channels // block)
        if height * width <= JOINT_POOLING_POSITIONS:  # every cell at once: (cells, positions) @ (positions, block)
            pool_t = np.ascontiguousarray(pooling_matrix(activation_shape, reduce).T.astype(np.float32))
            cells = pool_t.shape[0]
            maps = node("Reshape", [site, constant("maps_shape", np.array([-1, height * width, block], np.int64))])
            pooled = node("MatMul", [constant("pool_t", pool_t), maps])
        else:  # by rows, then by columns
            rows, columns = (np.ascontiguousarray(f.T.astype(np.float32))
                             for f in separable_pooling(activation_shape, reduce))
            cells = rows.shape[0] * columns.shape[0]
            maps = node("Reshape", [site, constant("maps_shape", np.array([-1, height, width * block], np.int64))])
            by_rows = node("Reshape", [node("MatMul", [constant("rows_t", rows), maps]),
                                       constant("by_rows_shape", np.array([-1, width, block], dtype=np.int64))])
            pooled = node("MatMul", [constant("columns_t", columns), by_rows])
        features = node("Reshape", [pooled, constant("features_shape",
                                                      np.array([-1, blocks * cells * block], dtype=np.int64))])
        # feature (channel c, cell k) is c * cells + k for the ramp; here (c // block, k, c % block), padding zero
        cell = np.arange(cells)[None, :, None]
        channel = (np.arange(blocks)[:, None, None] * block + np.arange(block)[None, None, :])
        eager = (channel * cells + cell).ravel()
        present = (channel < channels).repeat(cells, axis=1).ravel()
        eager = np.where(present, eager, 0)  # a padding channel's feature is zero: any row of the head will do
        center = np.where(present, center[eager], 0.0).astype(np.float32)
        weight_t = np.where(present[:, None], weight_t[eager], 0.0).astype(np.float32)
    elif reduce in POOLING_REDUCTIONS:
        channels, positions = activation_shape[0], int(np.prod(activation_shape[1:]))
        pool = pooling_matrix(activation_shape, reduce).astype(np.float32)
        maps = node("Reshape", [site, constant("maps_shape", np.array([-1, positions], dtype=np.int64))])
        pooled = node("MatMul", [maps, constant("pool", pool)])
        features = node("Reshape", [pooled, constant("features_shape",
                                                      np.array([-1, channels * pool.shape[1]], dtype=np.int64))])
    elif reduce == "identity":
        features = node("Flatten", [site], axis=1)
    elif reduce == "first_token":
        features = node("Gather", [site, constant("first", np.array(0, dtype=np.int64))], axis=1)
    elif reduce == "token_mean_masked":  # the sum over tokens by the count of tokens whose row is not all zero
        present = node("Cast", [node("Greater", [over_axis("ReduceMax", node("Abs", [site]), axis=2),
                                                 constant("zero", np.array(0.0, dtype=np.float32))])],
                       to=TensorProto.FLOAT)
        count = node("Max", [over_axis("ReduceSum", present, keepdims=1),
                             constant("one_token", np.array(1.0, dtype=np.float32))])
        features = node("Div", [over_axis("ReduceSum", site), count])
    else:
        features = over_axis("ReduceMean", site)
    value = node("Sub", [features, constant("center", center)])
    for index, (weight, bias) in enumerate(layers):
        suffix = str(index) if index else ""  # the first layer's names as a linear ramp's
        if index:
            value = node("Relu", [value])
        value = node("Gemm", [value, constant(f"weight_t{suffix}", weight_t if index == 0 else
                                              weight.T.astype(np.float32)),
                              constant(f"bias{suffix}", bias.astype(np.float32))],
                     output=f"{prefix}/logits" if index == len(layers) - 1 else "")
    logits = value
    probabilities = node("Softmax", [logits], axis=1)
    if score == "max_prob":
        confidence = node("ReduceMax", [probabilities], output=f"{prefix}/confidence", keepdims=0)
    else:  # entropy: confidence = 1 - entropy / log(classes), entropy = -sum p log p
        plogp = node("Mul", [probabilities, node("LogSoftmax", [logits], axis=1)])
        scaled = node("Mul", [node("ReduceMax", [over_axis("ReduceSum", plogp)], keepdims=0),
                              constant("inverse_log_classes", np.array(1.0 / np.log(ramp.spec.num_classes),
                                                                       dtype=np.float32))])
        confidence = node("Add", [scaled, constant("one", np.array(1.0, dtype=np.float32))],
                          output=f"{prefix}/confidence")
    return _tap(f"{prefix}:{score}", nodes, weights, logits, confidence, ramp.spec.num_classes)


def _tap(what: str, nodes: list, weights: dict[str, np.ndarray], logits: str, confidence: str, classes: int,
         libraries: tuple[OperatorLibrary, ...] = ()) -> Tap:
    """The tap of `nodes` reading `weights`, whose outputs are `logits` (rows, classes) and `confidence`, keyed by
    `what` it computes and a digest of its weights."""
    outputs = (helper.make_tensor_value_info(logits, TensorProto.FLOAT, ["batch", classes]),
               helper.make_tensor_value_info(confidence, TensorProto.FLOAT, []))
    # np.array, not np.ascontiguousarray, which makes a scalar (the first token's index) a vector
    initializers = tuple(numpy_helper.from_array(np.array(v, order="C"), name) for name, v in weights.items())
    digest = hashlib.sha256(b"".join(t.SerializeToString() for t in initializers)).hexdigest()[:16]
    return Tap(f"{what}@{digest}", tuple(nodes), initializers, outputs, libraries)
