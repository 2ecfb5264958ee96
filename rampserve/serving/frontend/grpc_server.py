"""The gRPC face of the server: KServe v2's `GRPCInferenceService` (health, server and model metadata, ModelInfer),
on grpcio's asyncio server in the HTTP server's process and event loop, through the same data plane.

The server starts once the models have, and stops before they do: told to stop, it accepts no new call and waits
(up to the grace period) for the calls in flight, whose requests the models then answer. Refusals are gRPC status
codes with the message HTTP would send: INVALID_ARGUMENT for a malformed request, NOT_FOUND for a model or version
not served, RESOURCE_EXHAUSTED for a request shed (with `retry-after` in the trailing metadata when the plane gives
one), UNAVAILABLE while a model's executor restarts, INTERNAL when the model failed. Triton's other methods
(streaming, model configuration, statistics, repository, shared memory) answer UNIMPLEMENTED.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import NoReturn

import grpc
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2 as pb

import rampserve
from rampserve.serving.frontend.grpc_codec import infer_request, infer_response, model_metadata_response
from rampserve.serving.frontend.plane import GRPC, DataPlane, Refusal
from rampserve.serving.shared.protocol import BINARY_DATA_EXTENSION, ProtocolError, server_metadata

SERVICE = "inference.GRPCInferenceService"
# HTTP's status for each refusal (the plane's) as a gRPC status code; a 503 that sheds load is RESOURCE_EXHAUSTED
STATUS_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND,
                413: grpc.StatusCode.INVALID_ARGUMENT, 429: grpc.StatusCode.RESOURCE_EXHAUSTED,
                500: grpc.StatusCode.INTERNAL, 503: grpc.StatusCode.UNAVAILABLE}


def status_code(refusal: Refusal) -> grpc.StatusCode:
    if refusal.outcome == "shed":
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    return STATUS_CODES.get(refusal.status, grpc.StatusCode.UNKNOWN)


async def abort(context: grpc.aio.ServicerContext, refusal: Refusal) -> NoReturn:
    metadata = () if refusal.retry_after_s is None else (("retry-after", str(refusal.retry_after_s)),)
    await context.abort(status_code(refusal), refusal.message, metadata)


def address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class GrpcFrontEnd:
    """KServe v2 over gRPC on `host:port` (0: a free port, known once started as `port`)."""

    def __init__(self, host: str, port: int, max_message_bytes: int, grace_s: float) -> None:
        self.host, self.port, self.max_message_bytes, self.grace_s = host, port, max_message_bytes, grace_s
        self._server: grpc.aio.Server | None = None

    def bind(self, plane: DataPlane, ready: Callable[[], bool]) -> None:
        """Take the port, on the running event loop; a port already taken raises RuntimeError (nothing else may
        share it: grpcio's default, SO_REUSEPORT, would let a second server take half of the calls silently)."""
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0),
                                          ("grpc.max_receive_message_length", self.max_message_bytes),
                                          ("grpc.max_send_message_length", -1)])
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers(plane, ready)),))
        try:
            self.port = server.add_insecure_port(address(self.host, self.port))
        except RuntimeError:
            raise RuntimeError(f"gRPC cannot listen on {address(self.host, self.port)} (is the port taken?): "
                               "--grpc-port N picks another, --no-grpc turns gRPC off") from None
        self._server = server

    async def start(self) -> None:
        """Serve calls (once the models have started)."""
        if self._server is None:
            raise RuntimeError("bind the gRPC server before starting it")
        await self._server.start()

    async def stop(self) -> None:
        """Accept no new call; those in flight get their answers (or are cancelled after the grace period)."""
        if self._server is not None:
            await self._server.stop(self.grace_s)
            self._server = None


def handlers(plane: DataPlane, ready: Callable[[], bool]) -> dict[str, grpc.RpcMethodHandler]:
    def unary(method: Callable[[object, grpc.aio.ServicerContext], Awaitable[object]],
              request: type) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(method, request.FromString, lambda reply: reply.SerializeToString())

    async def server_live(_request: pb.ServerLiveRequest, _context: grpc.aio.ServicerContext) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def server_ready(_request: pb.ServerReadyRequest, _context: grpc.aio.ServicerContext
                           ) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=ready())

    async def model_ready(request: pb.ModelReadyRequest, _context: grpc.aio.ServicerContext) -> pb.ModelReadyResponse:
        # As Triton answers: a model not served is not ready, no error (tritonclient's is_model_ready is False,
        # as over HTTP, where it reads the 404 so)
        try:
            available = plane.model_ready(request.name, request.version or None)  # served, with a signature
        except ProtocolError:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=ready() and available)

    async def server_metadata_of(_request: pb.ServerMetadataRequest, _context: grpc.aio.ServicerContext
                                 ) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(**server_metadata("rampserve", rampserve.__version__,
                                                           [BINARY_DATA_EXTENSION]))

    async def model_metadata(request: pb.ModelMetadataRequest, context: grpc.aio.ServicerContext
                             ) -> pb.ModelMetadataResponse:
        try:
            return model_metadata_response(plane.metadata(request.name, request.version or None))
        except ProtocolError as exc:
            await abort(context, Refusal(exc.status, exc.message, "invalid"))

    async def model_infer(body: bytes, context: grpc.aio.ServicerContext) -> bytes:
        arrived = time.monotonic()
        # Parsed here rather than by grpcio, which answers a message it cannot parse with INTERNAL
        try:
            message = pb.ModelInferRequest.FromString(body)
        except DecodeError as exc:
            await abort(context, plane.refuse("", ProtocolError(f"the request is not a ModelInferRequest: {exc}"),
                                              GRPC))
        result = await plane.answer(message.model_name, message.model_version or None,
                                    lambda inputs, texts: infer_request(message, inputs, alternative=texts),
                                    lambda answer: infer_response(answer, typed=not message.raw_input_contents),
                                    GRPC, arrived)
        if isinstance(result, Refusal):
            await abort(context, result)
        return result.SerializeToString()

    return {
        "ServerLive": unary(server_live, pb.ServerLiveRequest),
        "ServerReady": unary(server_ready, pb.ServerReadyRequest),
        "ModelReady": unary(model_ready, pb.ModelReadyRequest),
        "ServerMetadata": unary(server_metadata_of, pb.ServerMetadataRequest),
        "ModelMetadata": unary(model_metadata, pb.ModelMetadataRequest),
        "ModelInfer": grpc.unary_unary_rpc_method_handler(model_infer),  # bytes in and out
    }
