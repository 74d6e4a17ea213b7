"""A section's study: the method it is about, its plain reference, how rows derived from another row read, and
the tables and figures it adds.

Generic settings of ``[report]`` (any method's study):

    study = "pkg.module:NAME"     # a dict of the settings below that the others override; default "" (none)
    own = "NAME"                  # the study's method (a row label, and the algorithm a row may run under another
                                  #   label): the verdict, the lead rows and the robustness table judge it; "" none
    own_name = "Name"             # how those tables name it (default: the study's name for that own, else own)
    reference = "NAME"            # the plain baseline: the robustness table's share, rounds' automatic targets
    reference_name = "Name"       #   (default as own_name)
    [report.derived]              # how a derived row (a [[variants]] row with derive) reads, over the study's:
    name = "..."                  #   its row name (with " (ROW)" when derived from a row other than own)
    noun = "..."                  #   a short word for it in headers
    value = "KEY"                 #   a hyperparameter its rows split by, shown as "NAME = v"
    plot_key, divide_by           #   own's accuracy-vs-plot_key figure draws it at value / divide_by (a config key)
    matches, share, note          #   the verdict's wording where it matches own, the robustness note's, the note

A study's dict may also hold ``tables`` and ``figures`` (kind -> ``"pkg.module:builder"``): kinds it adds to the
report's registries (``hafedho.report.tables.TABLES``, ``hafedho.report.plots.FIGURES``), after the library's own.
A section with no study settings (a plain folder of runs, an index of a preset without them) has none: plain tables
and figures, no verdict. The HaFedHo paper's study is a plugin (``hafedho_paper.study:REPORT``, ``study/`` in this
repository) that its presets name.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hafedho.config import ConfigError
from hafedho.core.refs import import_reference, is_reference

KEYS = ("study", "own", "own_name", "reference", "reference_name", "derived")


@dataclass(frozen=True)
class DerivedView:
    name: str = "derived"
    noun: str = "derived row"
    value: str = ""
    plot_key: str = ""
    divide_by: str = ""
    matches: str = "the derived row explains the gain"
    share: str = "the derived row alone gives"
    note: str = ""


@dataclass(frozen=True)
class Study:
    own: str = ""
    own_name: str = ""
    reference: str = ""
    reference_name: str = ""
    derived: DerivedView = DerivedView()
    tables: Mapping[str, str] = field(default_factory=dict)  # kind -> builder reference, added by the study
    figures: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, report: dict[str, Any]) -> Study:
        """The study of a section's ``[report]`` settings, over its ``study`` reference (module docstring)."""
        ref = str(report.get("study", ""))
        base = dict(_study(ref)) if ref else {}
        settings = {**base, **{k: report[k] for k in KEYS if k in report}}

        def label_and_name(key: str) -> tuple[str, str]:  # a name goes with its label: the study's only for its own
            label = str(settings.get(key) or "")
            if f"{key}_name" in report:
                return label, str(report[f"{key}_name"])
            return label, str(base.get(f"{key}_name") or label) if label == base.get(key) else label

        derived = {**dict(base.get("derived") or {}), **dict(report.get("derived") or {})}
        unknown = sorted(set(derived) - set(DerivedView.__dataclass_fields__))
        if unknown:
            raise ConfigError(f"report.derived: unknown key(s) {', '.join(unknown)}")
        (own, own_name), (ref_label, ref_name) = label_and_name("own"), label_and_name("reference")
        view = DerivedView(**{k: str(v) for k, v in derived.items()})
        kinds = {key: _kinds(base.get(key), f"report.study={ref!r}: {key}") for key in ("tables", "figures")}
        return cls(own=own, own_name=own_name, reference=ref_label, reference_name=ref_name, derived=view, **kinds)

    def derived_name(self, of: str) -> str:
        """A derived row's name: ``derived.name``, plus ``(ROW)`` when it is derived from a row other than own."""
        return self.derived.name if of == self.own else f"{self.derived.name} ({of})"


def _study(ref: str) -> Mapping[str, Any]:
    """The mapping ``report.study`` names: read from a results folder, so only a plugin's unless the user trusts
    the package (``hafedho.core.refs.trusting``)."""
    study = import_reference("report.study", ref, ConfigError, from_folder=True)
    if not isinstance(study, Mapping):
        raise ConfigError(f"report.study={ref!r}: a {type(study).__name__}, not a mapping of study settings")
    return study


def _kinds(value: Any, where: str) -> dict[str, str]:
    """A study's ``tables``/``figures``: kind -> builder reference (``is_reference``), checked here."""
    value = value or {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and is_reference(v) for k, v in value.items()):
        raise ConfigError(f"{where}: a table of kind -> 'package.module:builder' references, e.g. {{mine = 'pkg.m:f'}}")
    return dict(value)


def load_builder(key: str, ref: str, not_one: str) -> Callable[..., Any]:
    """The table or figure builder ``ref`` names, read from a results folder (so imported only from trusted code,
    ``core.refs.trusting``): a Python function, else ``ConfigError(not_one)``."""
    fn = import_reference(key, ref, ConfigError, from_folder=True)
    if not inspect.isfunction(fn):
        raise ConfigError(not_one)
    return fn
