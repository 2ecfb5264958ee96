"""Every URL a server answers, and the handler that answers it."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import APIRouter, Depends, FastAPI

from rampserve.serving.frontend.dashboard import DashboardEndpoints
from rampserve.serving.frontend.endpoints.admin import AdminToken
from rampserve.serving.frontend.endpoints.applications import ApplicationEndpoints
from rampserve.serving.frontend.endpoints.observability import ObservabilityEndpoints
from rampserve.serving.frontend.endpoints.repository import RepositoryEndpoints
from rampserve.serving.frontend.endpoints.v2 import InferRoute, V2Endpoints


@dataclass(frozen=True)
class Endpoints:
    """A server's route handlers, each bound to what it answers from."""

    v2: V2Endpoints
    applications: ApplicationEndpoints
    repository: RepositoryEndpoints
    observability: ObservabilityEndpoints
    dashboard: DashboardEndpoints
    admin: AdminToken


def register_endpoints(app: FastAPI, endpoints: Endpoints) -> None:
    v2 = endpoints.v2
    app.add_api_route("/v2/health/live", v2.live, methods=["GET"])
    app.add_api_route("/v2/health/ready", v2.ready, methods=["GET"])
    app.add_api_route("/v2", v2.metadata, methods=["GET"])
    for model in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        app.add_api_route(model, v2.model_metadata, methods=["GET"])
        app.add_api_route(f"{model}/ready", v2.model_ready, methods=["GET"])
    app.add_middleware(InferRoute, v2=v2)  # {model}/infer: bare ASGI, ahead of the router

    applications = endpoints.applications
    app.add_api_route("/{app_name}/predict", applications.predict, methods=["POST"])
    app.add_api_route("/{app_name}/update", applications.update, methods=["POST"])
    app.add_api_route("/apps", applications.applications, methods=["GET"])
    app.add_api_route("/apps/{app_name}", applications.application, methods=["GET"])

    repository = endpoints.repository
    admin = APIRouter(dependencies=[Depends(endpoints.admin)])
    admin.add_api_route("/admin/apps", applications.register, methods=["POST"])
    admin.add_api_route("/admin/apps/{app_name}/models", applications.link, methods=["POST"])
    admin.add_api_route("/admin/apps/{app_name}", applications.remove, methods=["DELETE"])
    admin.add_api_route("/v2/repository/index", repository.index, methods=["POST"])
    admin.add_api_route("/v2/repository/models/{model}/load", repository.load, methods=["POST"])
    admin.add_api_route("/v2/repository/models/{model}/unload", repository.unload, methods=["POST"])
    app.include_router(admin)

    dashboard = endpoints.dashboard
    app.add_api_route("/dashboard", dashboard.page, methods=["GET"])
    app.add_api_route("/dashboard/static/{path:path}", dashboard.asset, methods=["GET"])
    app.add_api_route("/dashboard/data", dashboard.data, methods=["GET"])

    observability = endpoints.observability
    app.add_api_route("/metrics", observability.prometheus, methods=["GET"])
    app.add_api_route("/status", observability.status, methods=["GET"])
    app.add_api_route("/status/{model}", observability.model_status, methods=["GET"])
