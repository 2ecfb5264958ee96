"""Settings as MLServer and KServe users set them: the server's from RAMPSERVE_* environment variables with
`rampserve serve`'s flags over them, a repository of model folders each with its own model-settings.json, and a
bad setting refused at start with its key named. The repository is served for real, by `rampserve serve` in a
process of its own on a loopback port."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import typing
from dataclasses import dataclass, replace
from pathlib import Path
from types import NoneType

import pytest
from test_applications import const_onnx, infer
from test_serving import get_json
from typer.testing import CliRunner

import rampserve.serving.server as server_module
from rampserve.cli import app
from rampserve.control.controller import ControllerSettings
from rampserve.options import BOUNDS, option, options_of
from rampserve.serving.learning import LearningSettings
from rampserve.serving.server import build_state
from rampserve.serving.shared.settings import (
    ENV_PREFIX,
    MODEL_SETTINGS_FILE,
    ModelOptions,
    ModelSettings,
    RayOptions,
    ServeOptions,
    ServerSettings,
    declared_fields,
)

# What the server under test runs with, whatever the test sets: executors in the server's process and no waiting
# for compiled sets, so that it starts in seconds; and lines wide enough that rich does not fold an error's words
QUICK = {"RAMPSERVE_EXECUTOR": "thread", "RAMPSERVE_TORCHSCRIPT": "false", "RAMPSERVE_PRELOAD_S": "0",
         "COLUMNS": "1000", "TERMINAL_WIDTH": "1000"}


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
    assert options.server_settings() == ServerSettings()
    assert options.ray_options() == RayOptions()


def test_environment_variables_set_the_server_and_its_models(served_with) -> None:
    env = {"RAMPSERVE_HOST": "::1", "RAMPSERVE_PORT": "9000", "RAMPSERVE_GRPC_PORT": "0",
           "RAMPSERVE_ADMIN_TOKEN": "s3cret", "RAMPSERVE_EXECUTOR": "thread", "RAMPSERVE_DASHBOARD": "false",
           "RAMPSERVE_RAMP_BUDGET": "0.05", "RAMPSERVE_GUARANTEE": "long-run", "RAMPSERVE_MAX_BATCH": "8",
           "RAMPSERVE_TORCH_THREADS": "0"}
    result = run_serve(["m"], env)
    assert result.exit_code == 0, result.output
    ((models, model_settings, settings, apps, learning),) = served_with
    assert models == ["m"] and apps == [] and learning == LearningSettings()
    assert settings == ServerSettings(host="::1", port=9000, grpc_port=0, admin_token="s3cret", dashboard=False)
    assert model_settings == ModelSettings(
        executor="thread", max_batch=8, torch_threads=0,
        controller=ControllerSettings(ramp_budget=0.05, guarantee="long-run"))


def test_a_flag_overrides_the_environment(served_with) -> None:
    env = {"RAMPSERVE_PORT": "9000", "RAMPSERVE_RAMP_BUDGET": "0.05", "RAMPSERVE_DASHBOARD": "false",
           "RAMPSERVE_OBJECTIVE": "p95"}
    result = run_serve(["--port", "9100", "--ramp-budget", "0.03", "--dashboard", "--objective", "mean"], env)
    assert result.exit_code == 0, result.output
    ((_, model_settings, settings, _, _),) = served_with
    assert (settings.port, settings.dashboard) == (9100, True)
    assert (model_settings.controller.ramp_budget, model_settings.controller.objective) == (0.03, "mean")


@pytest.mark.parametrize(("env", "args", "named"), [
    ({"RAMPSERVE_PORT": "eighty"}, [], "RAMPSERVE_PORT='eighty'"),
    ({"RAMPSERVE_EXIT_MODE": "halt"}, [], "RAMPSERVE_EXIT_MODE='halt'"),
    ({"RAMPSERVE_MAX_BATCH": "0"}, [], "RAMPSERVE_MAX_BATCH='0'"),
    ({"RAMPSERVE_EXECUTOR": "fork"}, [], "RAMPSERVE_EXECUTOR='fork'"),
    ({"RAMPSERVE_EXECUTOR_POLICY": "realtime"}, [], "RAMPSERVE_EXECUTOR_POLICY='realtime'"),
    ({}, ["--accuracy-constraint", "1.5"], "--accuracy-constraint=1.5"),
], ids=["type", "exit mode", "range", "executor", "policy", "flag"])
def test_a_bad_value_is_refused_at_start_naming_its_variable_or_flag(served_with, env, args, named) -> None:
    result = run_serve(args, env)
    assert result.exit_code == 2, result.output
    assert named in words(result.output)
    assert served_with == []


def bundle_folder(folder: Path, bundle: Path, settings: dict | None = None) -> Path:
    """A repository's model folder: the prepared bundle's files (linked), and its settings file if given."""
    folder.mkdir(parents=True)
    for file in bundle.iterdir():
        (folder / file.name).symlink_to(file)
    if settings is not None:
        (folder / MODEL_SETTINGS_FILE).write_text(json.dumps(settings))
    return folder


@pytest.mark.parametrize(("contents", "named"), [
    ({"ramp_budjet": 0.05}, "unknown key 'ramp_budjet'"),
    ({"exit_mode": "halt"}, "exit_mode='halt': exit_mode must be one of"),
    ({"max_batch": "many"}, "max_batch='many'"),
    ({"slo_ms": -1}, "slo_ms=-1"),
    ([1, 2], "Input should be an object"),
], ids=["unknown key", "bad choice", "bad type", "out of range", "not an object"])
def test_a_bad_settings_file_stops_the_server_naming_the_file_and_key(tmp_path, resnet_bundle, served_with, contents,
                                                                      named) -> None:
    """The server as the command builds it, up to serving: the repository is checked before anything loads."""
    folder = bundle_folder(tmp_path / "repo" / "good", resnet_bundle, {"ramp_budget": 0.05})
    bad = bundle_folder(tmp_path / "repo" / "bad", resnet_bundle)
    (bad / MODEL_SETTINGS_FILE).write_text(json.dumps(contents))
    settings = ServerSettings(port=0, grpc=False, repository=folder.parent)
    with pytest.raises(ValueError) as refused:
        build_state([], ModelSettings(), settings)
    assert f"{bad / MODEL_SETTINGS_FILE}: " in str(refused.value) and named in str(refused.value)


def test_a_model_folder_without_a_model_stops_the_server(tmp_path, resnet_bundle) -> None:
    bundle_folder(tmp_path / "repo" / "good", resnet_bundle)
    (tmp_path / "repo" / "empty").mkdir()
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'repo' / 'empty'} holds no model")):
        build_state([], ModelSettings(), ServerSettings(port=0, grpc=False, repository=tmp_path / "repo"))


def test_settings_beside_a_model_that_takes_none_are_refused(tmp_path) -> None:
    const_onnx(tmp_path / "repo" / "clf" / "model.onnx", 1)
    (tmp_path / "repo" / "clf" / MODEL_SETTINGS_FILE).write_text('{"ramp_budget": 0.05}')
    with pytest.raises(ValueError, match="settings apply to prepared bundles"):
        build_state([], ModelSettings(), ServerSettings(port=0, grpc=False, repository=tmp_path / "repo"))


def start(args: list[str], env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rampserve.cli", "serve", *args], env={**os.environ, **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_the_command_exits_on_a_bad_settings_file_before_serving(tmp_path, resnet_bundle) -> None:
    bundle_folder(tmp_path / "repo" / "m", resnet_bundle, {"accuracy_constraint": 2})
    process = start(["--repository", str(tmp_path / "repo"), "--port", "0", "--grpc-port", "0"], QUICK)
    try:
        out, err = process.communicate(timeout=300)
    finally:
        process.kill()
    assert process.returncode == 2
    assert "rampserve: serving" not in out
    assert f"{MODEL_SETTINGS_FILE}: accuracy_constraint=2: Input should be less than 1" in words(err)


def test_a_repository_serves_each_model_with_its_settings_file_over_the_environment_and_flags(
        tmp_path, resnet_bundle, fmnist_feeds) -> None:
    """Two model folders holding the same bundle: `fast` sets its controller and batching in its file, `slow` its
    SLO and deadline; what a file leaves unset comes from the flags, then the environment."""
    root = tmp_path / "repo"
    bundle_folder(root / "fast", resnet_bundle, {"ramp_budget": 0.05, "accuracy_constraint": 0.02,
                                                 "exit_mode": "stop", "guarantee": "long-run", "max_batch": 2})
    bundle_folder(root / "slow", resnet_bundle, {"slo_ms": 40, "deadline_ms": 500})
    env = {**QUICK, "RAMPSERVE_REPOSITORY": str(root), "RAMPSERVE_PORT": "0", "RAMPSERVE_GRPC_PORT": "0",
           "RAMPSERVE_RAMP_BUDGET": "0.07", "RAMPSERVE_MAX_BATCH": "8"}
    process = start(["--max-batch", "4"], env)
    try:
        line = process.stdout.readline()
        found = re.search(r"http://[\d.]+:\d+", line)
        assert found, (line, process.stderr.read() if process.poll() is not None else "")
        url = found.group(0)
        fast, slow = get_json(f"{url}/status/fast"), get_json(f"{url}/status/slow")
        answers = {name: infer(url, name, fmnist_feeds[:2])[0] for name in ("fast", "slow")}
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    finally:
        process.kill()
    assert answers == {"fast": 200, "slow": 200}
    assert (fast["ramp_budget"], fast["bound"]["constraint"], fast["exit_mode"], fast["guarantee"],
            fast["max_batch"], fast["deadline_ms"]) == (0.05, 0.02, "stop", "average", 2, None)  # its former name
    assert (slow["ramp_budget"], slow["bound"]["constraint"], slow["exit_mode"], slow["guarantee"],
            slow["max_batch"], slow["slo_ms"], slow["deadline_ms"]) == (0.07, 0.01, "release", "certified", 4, 40.0,
                                                                        500.0)


@pytest.mark.parametrize("batch_limit", [1, 2, 3, 16])
@pytest.mark.parametrize("compiled", [True, False])
def test_auto_exit_mode_stops_only_small_compiled_batches_and_a_named_mode_stays(batch_limit, compiled) -> None:
    auto = ControllerSettings()
    assert auto.exit_mode == "auto" and not auto.stops  # unresolved, it is served as release mode
    resolved = auto.resolved(batch_limit, compiled)
    assert resolved.exit_mode == ("stop" if compiled and batch_limit <= 2 else "release")
    assert replace(resolved, exit_mode="auto") == auto  # nothing else changed
    for named in ("release", "stop"):
        assert ControllerSettings(exit_mode=named).resolved(batch_limit, compiled).exit_mode == named


def test_a_served_model_resolves_auto_by_its_batch_limit_and_a_vanilla_one_runs_every_input_to_the_end(
        resnet_prepared) -> None:
    profile = resnet_prepared.profile
    assert ModelSettings(max_batch=2).controller_for(profile).exit_mode == "stop"
    assert ModelSettings(max_batch=8).controller_for(profile).exit_mode == "release"
    assert ModelSettings(max_batch=2, torchscript=False).controller_for(profile).exit_mode == "release"
    assert ModelSettings(max_batch=2, vanilla=True).controller_for(profile).exit_mode == "release"


# Tests made from the declaration itself: every option of every settings class, as a user sets it
DECLARED = {cls: options_of(cls) for cls in (ModelSettings, ControllerSettings, ServerSettings, RayOptions)}
OPTIONS = [(cls, name) for cls, declared in DECLARED.items() for name in declared]
TAKES_A_FLAG = [(cls, name) for cls, name in OPTIONS if cls is not RayOptions]  # --ray deploys instead of serving


def kinds(cls: type, name: str) -> tuple[type, ...]:
    """The types an option's value may have (`float | None`: float and NoneType)."""
    annotation = typing.get_type_hints(cls)[name]
    return typing.get_args(annotation) or (annotation,)


def another_value(cls: type, name: str) -> object:
    """A value of the option other than its default, that its declaration and its class take."""
    declared_field, declared = DECLARED[cls][name]
    kind = next(arg for arg in kinds(cls, name) if arg is not NoneType)
    default = declared_field.default
    if declared.choices:
        return next(choice for choice in declared.choices if choice != default)
    if kind is bool:
        return not default
    if kind is int:
        return (default if default is not None else declared.ge or 1) + 1
    if kind is float:
        return default / 2 if default else 0.5
    if kind is Path:
        return Path("/srv/models")
    return {"host": "::1", "store": "memory", "autoscaling": '{"min_replicas": 1}'}.get(name, f"{default}-other")


def as_text(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def reached(cls: type, name: str, model_settings: ModelSettings, server_settings: ServerSettings) -> object:
    """The option's value in the settings the server was given."""
    of = {ModelSettings: model_settings, ControllerSettings: model_settings.controller, ServerSettings: server_settings}
    return getattr(of[cls], name)


def test_every_declared_option_is_one_flag_one_variable_and_one_key_with_its_declared_default_and_help() -> None:
    assert set(ServeOptions.model_fields) == {name for _, name in OPTIONS}  # nothing declared elsewhere
    assert set(ModelOptions.model_fields) == set(DECLARED[ModelSettings]) | set(DECLARED[ControllerSettings])
    for cls, name in OPTIONS:
        declared_field, declared = DECLARED[cls][name]
        made = ServeOptions.model_fields[name]
        assert (made.default, made.description) == (declared_field.default, declared.help), name
    help_text = words(run_serve(["--help"], {"COLUMNS": "1000", "TERMINAL_WIDTH": "1000"}).output)
    for _, name in OPTIONS:
        assert f"--{name.replace('_', '-')}" in help_text and f"{ENV_PREFIX}{name.upper()}" in help_text, name


@pytest.mark.parametrize(("cls", "name"), OPTIONS, ids=[name for _, name in OPTIONS])
def test_each_option_set_by_its_variable_reaches_its_settings_class(cls, name, monkeypatch) -> None:
    value = another_value(cls, name)
    monkeypatch.setenv(f"{ENV_PREFIX}{name.upper()}", as_text(value))
    options = ServeOptions.read({})
    if cls is RayOptions:
        assert getattr(options.ray_options(), name) == value
    else:
        assert reached(cls, name, options.model_settings(), options.server_settings()) == value


@pytest.mark.parametrize(("cls", "name"), TAKES_A_FLAG, ids=[name for _, name in TAKES_A_FLAG])
def test_each_option_set_by_its_flag_reaches_the_server(cls, name, served_with) -> None:
    value = another_value(cls, name)
    flag = f"--{name.replace('_', '-')}"
    args = [flag if value else f"--no-{flag[2:]}"] if isinstance(value, bool) else [flag, as_text(value)]
    result = run_serve(["m", *args])
    assert result.exit_code == 0, result.output
    ((_, model_settings, server_settings, _, _),) = served_with
    assert reached(cls, name, model_settings, server_settings) == value


BOUNDED = [(cls, name, getattr(DECLARED[cls][name][1], key), key) for cls, name in OPTIONS for key, _, _ in BOUNDS
           if getattr(DECLARED[cls][name][1], key) is not None]


@pytest.mark.parametrize(("cls", "name", "bound", "key"), BOUNDED, ids=[f"{n}-{k}" for _, n, _, k in BOUNDED])
def test_a_value_outside_its_declared_range_is_refused_by_its_class_and_by_the_command(cls, name, bound, key,
                                                                                         served_with) -> None:
    step = 1 if int in kinds(cls, name) else 0.5
    outside = {"ge": bound - step, "gt": bound, "le": bound + step, "lt": bound}[key]
    with pytest.raises(ValueError, match=f"{name} must be"):
        cls(**{name: outside})
    result = run_serve(["m"], {f"{ENV_PREFIX}{name.upper()}": as_text(outside)})
    assert result.exit_code == 2 and f"{ENV_PREFIX}{name.upper()}='{as_text(outside)}'" in words(result.output)
    assert served_with == []


def test_the_pydantic_fields_refuse_an_option_declared_twice() -> None:
    @dataclass(frozen=True)
    class Twice:
        port: int = option(1, "again")

    with pytest.raises(TypeError, match="option port is declared twice"):
        declared_fields(ServerSettings, Twice)
