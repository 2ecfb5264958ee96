"""The controller settings `serve`, `bench sim` and `bench live` take alike: each reaches ControllerSettings when
given, and a bad one is refused before anything runs."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from rampserve.bench.live import LiveSettings
from rampserve.cli import CONTROLLER_OPTIONS, app, controller_options


def test_controller_options_reach_the_command_as_controller_settings_fields():
    heard: list[dict] = []
    demo = typer.Typer()

    @demo.command()
    @controller_options
    def command(name: str = "x", *, controller_flags: dict[str, object]) -> None:
        heard.append({"name": name, **controller_flags})

    runner = CliRunner()
    assert runner.invoke(demo, ["--name", "y", "--objective", "p95", "--search-every", "1024",
                                "--shadow-share", "0.1", "--guarantee", "windowed", "--windows-below", "0.1",
                                "--no-prime"]).exit_code == 0
    assert runner.invoke(demo, []).exit_code == 0
    assert heard == [{"name": "y", "objective": "p95", "guarantee": "windowed", "windows_below": 0.1,
                      "search_every": 1024, "shadow_share": 0.1, "prime": False}, {"name": "x"}]
    assert set(CONTROLLER_OPTIONS) == {"objective", "guarantee", "promise_window", "windows_below", "risk_target_share",
                                       "confidence", "search_every", "history", "shadow_share", "prime"}


def test_bench_live_gives_the_managed_server_a_flag_as_a_flag():
    settings = LiveSettings(controller={"prime": False, "search_every": 512, "risk_target_share": 0.5})
    assert settings.managed_args()[-5:] == ("--no-prime", "--search-every", "512", "--risk-target-share", "0.5")


@pytest.mark.parametrize("command", [["serve"], ["bench", "sim"], ["bench", "live"]])
@pytest.mark.parametrize("bad", [["--objective", "p75"], ["--guarantee", "hopeful"]])
def test_a_bad_controller_setting_is_refused_before_anything_runs(command, bad):
    result = CliRunner().invoke(app, [*command, *bad])
    assert result.exit_code == 2, result.output
    assert "must be one of" in result.output
