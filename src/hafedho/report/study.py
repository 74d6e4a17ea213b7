"""A section's study: the method it is about, its plain reference, and how rows derived from another row read.

Generic settings of ``[report]`` (any method's study):

    study = "pkg.module:NAME"     # a dict of the settings below that the others override ("" none); default:
                                  #   DEFAULTS where own is unset too, else none
    own = "NAME"                  # the study's method (a row label, and the algorithm a row may run under another
                                  #   label): the verdict, the lead rows and the robustness table judge it; "" none
    own_name = "Name"             # how those tables name it (default: the study's name for that own, else own)
    reference = "NAME"            # the plain baseline: the robustness table's share, rounds' automatic targets
    reference_name = "Name"       #   (default as own_name)
    [report.derived]              # how a derived row (a [[variants]] row with derive) reads, over the study's:
    name = "..."                  #   its row name (with " (ROW)" when derived from a row other than own)
    noun = "..."                  #   a short word for it in headers ("twin")
    value = "KEY"                 #   a hyperparameter its rows split by, shown as "NAME = v"
    plot_key, divide_by           #   own's accuracy-vs-plot_key figure draws it at value / divide_by (a config key)
    matches, share, note          #   the verdict's wording where it matches own, the robustness note's, the note

``DEFAULTS`` is the HaFedHo study's (``hafedho.paper.study``, loaded by reference as the engine registry loads
engines): a plain folder of runs and an index written before these settings existed imply it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hafedho.config import ConfigError
from hafedho.core.refs import import_reference

DEFAULTS = "hafedho.paper.study:REPORT"
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

    @classmethod
    def of(cls, report: dict[str, Any]) -> Study:
        """The study of a section's ``[report]`` settings, over its ``study`` reference (module docstring)."""
        ref = str(report.get("study", DEFAULTS if "own" not in report else ""))
        base = dict(import_reference("report.study", ref, ConfigError)) if ref else {}  # type: ignore[call-overload]
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
        return cls(own=own, own_name=own_name, reference=ref_label, reference_name=ref_name, derived=view)

    def derived_name(self, of: str) -> str:
        """A derived row's name: ``derived.name``, plus ``(ROW)`` when it is derived from a row other than own."""
        return self.derived.name if of == self.own else f"{self.derived.name} ({of})"
