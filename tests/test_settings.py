"""Settings as MLServer and KServe users set them: the server's from RAMPSERVE_* environment variables with
`rampserve serve`'s flags over them, and a bad setting refused at start with its key named."""

from __future__ import annotations

from dataclasses import replace

import pytest
from typer.testing import CliRunner

import rampserve.serving.server as server_module
from rampserve.cli import app
from rampserve.control.controller import ControllerSettings
from rampserve.serving.server import ServerSettings
from rampserve.serving.settings import ENV_PREFIX, ServeOptions
from rampserve.serving.worker import ModelSettings

@pytest.fixture(autouse=True)
def no_server_variables(monkeypatch) -> None:
    """The tests' own environment only: none of the server's variables from the one pytest runs in."""
    for name in ServeOptions.model_fields:
        monkeypatch.delenv(f"{ENV_PREFIX}{name.upper()}", raising=False)


@pytest.fixture
def served_with(monkeypatch) -> list[tuple]:
    """`rampserve serve` with the server itself replaced: each call's models, ModelSettings, ServerSettings and
    applications, as the command would have served them."""
    calls: list[tuple] = []
    monkeypatch.setattr(server_module, "serve", lambda *args: calls.append(args))
    return calls


def run_serve(args: list[str], env: dict[str, str] | None = None):
    return CliRunner().invoke(app, ["serve", *args], env=env)


def words(output: str) -> str:
    """The command's output as one line: rich wraps an error in a box, across lines."""
    return " ".join(output.replace("│", " ").split())


def test_the_defaults_are_the_settings_classes_own() -> None:
    options = ServeOptions.read({})
    assert options.model_settings() == ModelSettings()
    assert replace(options.server_settings(), grpc_port=None) == ServerSettings()
    assert options.server_settings().grpc_port == 8001  # the command serves gRPC unless told not to


def test_environment_variables_set_the_server_and_its_models(served_with) -> None:
    env = {"RAMPSERVE_HOST": "::1", "RAMPSERVE_PORT": "9000", "RAMPSERVE_GRPC_PORT": "0",
           "RAMPSERVE_ADMIN_TOKEN": "s3cret", "RAMPSERVE_EXECUTOR": "thread", "RAMPSERVE_DASHBOARD": "false",
           "RAMPSERVE_RAMP_BUDGET": "0.05", "RAMPSERVE_GUARANTEE": "long-run", "RAMPSERVE_MAX_BATCH": "8",
           "RAMPSERVE_TORCH_THREADS": "0"}
    result = run_serve(["m"], env)
    assert result.exit_code == 0, result.output
    ((models, model_settings, settings, apps),) = served_with
    assert models == ["m"] and apps == []
    assert settings == ServerSettings(host="::1", port=9000, grpc_port=None, admin_token="s3cret", dashboard=False)
    assert model_settings == ModelSettings(
        executor="thread", max_batch=8, torch_threads=None,
        controller=ControllerSettings(ramp_budget=0.05, guarantee="long-run"))


def test_a_flag_overrides_the_environment(served_with) -> None:
    env = {"RAMPSERVE_PORT": "9000", "RAMPSERVE_RAMP_BUDGET": "0.05", "RAMPSERVE_DASHBOARD": "false",
           "RAMPSERVE_OBJECTIVE": "p95"}
    result = run_serve(["--port", "9100", "--ramp-budget", "0.03", "--dashboard", "--objective", "mean"], env)
    assert result.exit_code == 0, result.output
    ((_, model_settings, settings, _),) = served_with
    assert (settings.port, settings.dashboard) == (9100, True)
    assert (model_settings.controller.ramp_budget, model_settings.controller.objective) == (0.03, "mean")


@pytest.mark.parametrize(("env", "args", "named"), [
    ({"RAMPSERVE_PORT": "eighty"}, [], "RAMPSERVE_PORT='eighty'"),
    ({"RAMPSERVE_EXIT_MODE": "halt"}, [], "RAMPSERVE_EXIT_MODE='halt'"),
    ({"RAMPSERVE_MAX_BATCH": "0"}, [], "RAMPSERVE_MAX_BATCH='0'"),
    ({"RAMPSERVE_EXECUTOR": "fork"}, [], "RAMPSERVE_EXECUTOR='fork'"),
    ({}, ["--accuracy-constraint", "1.5"], "--accuracy-constraint=1.5"),
], ids=["type", "exit mode", "range", "executor", "flag"])
def test_a_bad_value_is_refused_at_start_naming_its_variable_or_flag(served_with, env, args, named) -> None:
    result = run_serve(args, env)
    assert result.exit_code == 2, result.output
    assert named in words(result.output)
    assert served_with == []
