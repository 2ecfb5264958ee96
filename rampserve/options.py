"""One declaration per setting: a settings dataclass's field, with its default, what it does and the range it must lie
in (`option`). The settings classes check their values with it (`check_options`), and the server's flags, its
RAMPSERVE_* variables and a model's model-settings.json keys are made from it (`serving.shared.settings`), so that a
setting's name, default, meaning and range are written once."""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import MISSING, dataclass
from typing import Any

BOUNDS = (("ge", ">=", operator.ge), ("gt", ">", operator.gt), ("le", "<=", operator.le), ("lt", "<", operator.lt))


@dataclass(frozen=True)
class Option:
    """What a setting does, as its flag's help says, and the values it takes: bounds (None: none) and choices."""

    help: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[str, ...] | None = None

    def problem(self, name: str, value: object) -> str | None:
        """Why `value` is refused for setting `name`, or None. None itself is never refused here (a setting that
        takes it says so in its type)."""
        if value is None:
            return None
        if self.choices is not None and value not in self.choices:
            return f"{name} must be one of {self.choices}, got {value!r}"
        for key, sign, holds in BOUNDS:
            bound = getattr(self, key)
            if bound is not None and not holds(value, bound):
                return f"{name} must be {sign} {bound:g}, got {value!r}"
        return None


def option(default: Any = MISSING, help: str = "", *, default_factory: Any = MISSING, **values: Any) -> Any:
    """A settings field that is also an option of the server (its flag, variable and settings key)."""
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={"option": Option(help, **values)})


def options_of(settings: type) -> dict[str, tuple[dataclasses.Field, Option]]:
    """A settings class's options, by name, in declaration order."""
    return {f.name: (f, f.metadata["option"]) for f in dataclasses.fields(settings) if "option" in f.metadata}


def check_options(settings: object) -> None:
    """ValueError for the first option of `settings` whose value its declaration refuses."""
    for name, (_, declared) in options_of(type(settings)).items():
        problem = declared.problem(name, getattr(settings, name))
        if problem is not None:
            raise ValueError(problem)
