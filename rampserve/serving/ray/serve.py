"""rampserve on Ray Serve: the same HTTP API (v2, applications, `/metrics`, `/status`) served by the replicas of
one deployment, each with its own batchers and early-exit executors. Each model has one controller for all
replicas, a Ray actor (`ray/control.py`), so accuracy is judged over all of its traffic. Replica count and
autoscaling pass through to Ray Serve unchanged. gRPC is not served here: Ray Serve's proxy owns the ports and
speaks gRPC only to services registered with it, so replicas serve HTTP alone.

Ray is an optional dependency (`pip install rampserve[ray]`); this module imports it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import ray
from fastapi import FastAPI
from ray import serve

from rampserve.serving.executor.loading import load_served
from rampserve.serving.frontend.app import create_app
from rampserve.serving.frontend.apps.applications import ApplicationSpec
from rampserve.serving.ray.control import RayControl
from rampserve.serving.server import ServerSettings, build_state, check_admin_access
from rampserve.serving.shared.contract import GIL_SWITCH_INTERVAL_S, ControlLink, freeze_startup_objects
from rampserve.serving.shared.models import ServedModel
from rampserve.serving.shared.settings import ModelSettings


@dataclass(frozen=True)
class RayDeployment:
    name: str = "rampserve"
    replicas: int = 1
    autoscaling: dict | None = None  # Ray Serve's autoscaling_config; replaces `replicas` when given
    replica_cpus: float = 1.0  # each replica runs its executors on one core, as the standalone server does
    max_ongoing_requests: int = 256  # Ray Serve's own admission limit per replica, above rampserve's queues
    extra_options: dict = field(default_factory=dict)  # any other `serve.deployment` option


def shared_controllers(settings: ModelSettings) -> Callable[[ServedModel], ControlLink | None]:
    def link(served: ServedModel) -> ControlLink | None:
        return None if settings.vanilla else RayControl(served.name, served.profile,
                                                             settings.controller_for(served.profile))

    return link


def build_replica_app(refs: Sequence[str], model_settings: ModelSettings, settings: ServerSettings,
                      apps: Sequence[ApplicationSpec]) -> FastAPI:
    """One replica's server, built on the replica (Ray Serve calls this there and runs its lifespan)."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    models = [load_served(ref) for ref in refs]
    state = build_state(models, model_settings, settings, apps, shared_controllers(model_settings))
    freeze_startup_objects()
    return create_app(state)


class RampserveReplica:
    """A replica of the deployment; its ASGI app (rampserve's server) does all the work."""


def application(refs: Sequence[str], model_settings: ModelSettings, settings: ServerSettings,
                apps: Sequence[ApplicationSpec] = (), deployment: RayDeployment = RayDeployment()
                ) -> serve.Application:
    refs, apps = list(refs), list(apps)

    def builder() -> FastAPI:  # a plain function: Ray Serve takes any other callable for an ASGI app itself
        return build_replica_app(refs, model_settings, settings, apps)

    scaling = ({"autoscaling_config": deployment.autoscaling} if deployment.autoscaling is not None
               else {"num_replicas": deployment.replicas})
    replica = serve.deployment(serve.ingress(builder)(RampserveReplica), name=deployment.name,
                               ray_actor_options={"num_cpus": deployment.replica_cpus},
                               max_ongoing_requests=deployment.max_ongoing_requests,
                               **scaling, **deployment.extra_options)
    return replica.bind()


def serve_on_ray(refs: Sequence[str], model_settings: ModelSettings, settings: ServerSettings,
                 apps: Sequence[ApplicationSpec] = (), deployment: RayDeployment = RayDeployment()) -> None:
    """Deploy on the Ray cluster named by RAY_ADDRESS (or a local one) and serve until interrupted; Ray Serve's
    proxy listens on the server's host and port."""
    check_admin_access(settings)  # before any replica starts, which would refuse the same way
    if settings.grpc:
        print("rampserve: no gRPC on Ray Serve (its proxy serves HTTP here); --grpc is ignored", flush=True)
        settings = replace(settings, grpc=False)  # replicas on one machine would all take the same port
    ray.init(namespace="rampserve")  # named: the models' controllers are detached actors found by name
    serve.start(http_options={"host": settings.host, "port": settings.port})
    scale = deployment.autoscaling or f"{deployment.replicas} replica(s)"
    print(f"rampserve: deploying {', '.join(refs)} on Ray Serve ({scale}) at http://{settings.host}:{settings.port}",
          flush=True)
    serve.run(application(refs, model_settings, settings, apps, deployment), name=deployment.name,
              route_prefix="/", blocking=True)
