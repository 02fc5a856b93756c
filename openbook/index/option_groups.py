"""A group of typer options written once, that every command offering it takes as one object.

An option group is a frozen dataclass whose fields are typer options (``Annotated[T,
typer.Option(...)]`` with a default). A command decorated with :func:`takes_option_groups`
names the group as one parameter (``ann: AnnOptions``); its command line shows the group's
fields as options in that parameter's place, with the flags, envvars, defaults and help the
fields declare, and the command is called with the dataclass built from them. So ``build`` and
``import`` declare their shared options once, and read them as one typed value each.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from typing import Any


def takes_option_groups(command: Callable[..., None]) -> Callable[..., None]:
    """``command`` with each parameter typed as a dataclass replaced by that dataclass's fields
    (keyword-only options, in the parameter's place); called with the dataclass built from
    them. The parameter's own default (``ann: AnnOptions = AnnOptions()``) serves a direct call
    only. Apply it below ``@app.command()``."""
    signature = inspect.signature(command, eval_str=True)
    groups: dict[str, tuple[type[Any], list[str]]] = {}  # parameter -> (its dataclass, fields)
    parameters: list[inspect.Parameter] = []
    for parameter in signature.parameters.values():
        group = parameter.annotation
        if not (isinstance(group, type) and dataclasses.is_dataclass(group)):
            parameters.append(parameter)
            continue
        fields = _options(group)
        groups[parameter.name] = (group, [f.name for f in fields])
        parameters.extend(fields)
    names = [p.name for p in parameters]
    if len(set(names)) != len(names):
        raise TypeError(f"{command.__name__}: an option group's field repeats another option")
    # why: a keyword-only parameter may not stand before a positional one with a default-less
    # one after it; typer calls with keywords only, so every option can be keyword-only
    parameters = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in parameters]

    @functools.wraps(command)
    def run(**kwargs: Any) -> None:
        for name, (group, fields) in groups.items():
            kwargs[name] = group(**{field: kwargs.pop(field) for field in fields})
        command(**kwargs)

    run.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    run.__annotations__ = {p.name: p.annotation for p in parameters} | {"return": None}
    return run


def _options(group: type[Any]) -> list[inspect.Parameter]:
    """The fields of the dataclass ``group`` as keyword-only parameters (a field without a
    default: a required option), their annotations resolved with typer's ``Annotated``
    metadata kept."""
    hints = typing.get_type_hints(group, include_extras=True)
    options = []
    for field in dataclasses.fields(group):
        default = inspect.Parameter.empty if field.default is dataclasses.MISSING else field.default
        options.append(
            inspect.Parameter(
                field.name,
                inspect.Parameter.KEYWORD_ONLY,
                default=default,
                annotation=hints[field.name],
            )
        )
    return options
