"""The detector tables of the docs (``docs/concepts/detectors.md``, ``docs/CONTRACTS.md``, the
parameter reference ``docs/reference/detector-parameters.md``), from the registry.

Each table sits between two markers; ``python -m stability.config.registry_docs`` rewrites what is
between them from :data:`stability.config.registry.REGISTRY` (the ``doc`` row, class, inputs, default
kind and tuning grid of every entry), ``--check`` only reports stale files (exit status 1).
``tests/test_registry_docs.py`` fails when a file differs from the generated text, so a detector
is documented by its registry entry and nowhere else.

>>> print(detectors_table({"nonfinite": REGISTRY["nonfinite"]}))
| registry name | class | how it works |
|---|---|---|
| `nonfinite` | `NonFiniteGuard` | Alarms on every NaN/±inf element. Keeps the count and the current streak. |
"""  # noqa: E501

from __future__ import annotations

import argparse
import inspect
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

from detectors import BankDetector, Constraint
from stability.config.registry import _N_INPUT_ARGS, REGISTRY, RegistryEntry, detector_class

__all__ = ["BEGIN", "END", "TABLES", "contracts_table", "detectors_table", "main",
           "parameter_docs", "parameters_table", "render", "stale_files"]

BEGIN = "<!-- detector-table: generated from stability/config/registry.py by " \
        "`python -m stability.config.registry_docs`; do not edit -->"
END = "<!-- /detector-table -->"

Registry = Mapping[str, RegistryEntry]


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def parameter_docs(cls: type) -> dict[str, str]:
    """Each argument's description in ``cls``'s numpy-style ``Parameters`` section.

    Names listed together (``alpha, warmup``) share one description.

    >>> from detectors import NonFiniteGuard
    >>> parameter_docs(NonFiniteGuard)["freeze_on_alarm"]
    'Must be ``False``: the guard has no statistics to freeze.'
    """
    lines = (inspect.getdoc(cls) or "").splitlines()
    out: dict[str, list[str]] = {}
    names: list[str] = []
    inside = False
    for i, line in enumerate(lines):
        header = i + 1 < len(lines) and lines[i + 1].strip() and set(lines[i + 1]) == {"-"}
        if header:
            inside = line.strip() == "Parameters"
            names = []
        elif inside and line and not line.startswith(" ") and set(line) != {"-"}:
            names = [n.strip() for n in line.split(":")[0].split(",")]
            for n in names:
                out[n] = []
        elif inside and line.strip():
            for n in names:
                out[n].append(line.strip())
    return {k: " ".join(v) for k, v in out.items()}


def detectors_table(registry: Registry | None = None) -> str:
    """``docs/concepts/detectors.md``'s table: registry name, class, how it works."""
    reg = REGISTRY if registry is None else registry
    rows = ["| registry name | class | how it works |", "|---|---|---|"]
    for name, e in reg.items():
        rows.append(f"| `{name}` | `{e.target.split(':')[1]}` | {_cell(e.doc)} |")
    return "\n".join(rows)


def _inputs(name: str) -> str:
    cls = detector_class(name)
    args = inspect.signature(cls).parameters
    if any(a in args for a in _N_INPUT_ARGS):
        return "one per bound pattern"
    return ", ".join(cls.input_names)


def _grid(name: str, e: RegistryEntry) -> str:
    cls = detector_class(name)
    if "threshold" not in inspect.signature(cls).parameters or getattr(
            cls, "fixed_threshold", False):
        return "not tuned"
    parts = ["threshold"] + [f"`{k}` {', '.join(map(str, v))}" for k, v in e.grid.items()]
    return " × ".join(parts)


def contracts_table(registry: Registry | None = None) -> str:
    """``docs/CONTRACTS.md``'s table: name, class, inputs, default kind, tuning grid."""
    reg = REGISTRY if registry is None else registry
    rows = ["| name | class | inputs | default kind | tuned by `replay.tuning` |",
            "|---|---|---|---|---|"]
    for name, e in reg.items():
        kind = e.kind or "by binding (`stability.config.config.infer_kind`)"
        rows.append(f"| `{name}` | `{e.target.replace(':', '.')}` | {_inputs(name)} | {kind} | "
                    f"{_grid(name, e)} |")
    return "\n".join(rows)


def _accepts(rule: Constraint, det: BankDetector) -> str:
    """The rule with the defaults, and what a bound that depends on other arguments follows."""
    text = rule.rule(det)
    bounds = [getattr(rule, "lo", None), getattr(rule, "hi", None), getattr(rule, "count", None)]
    for b in bounds:
        if isinstance(b, str):
            text += f" (with the defaults: the bound is `{b}`)"
        elif callable(b):
            why = (inspect.getdoc(b) or b.__name__).rstrip(".")
            text += f" (with the defaults: {why[:1].lower()}{why[1:]})"
    return text


def _default(arg: str, default: object, rule: Constraint | None) -> str:
    derive = getattr(rule, "derive", None)
    if default is None and derive is not None:
        return f"`None`: {(inspect.getdoc(derive) or 'derived').rstrip('.')}"
    return f"`{default!r}`"


def parameters_table(registry: Registry | None = None) -> str:
    """``docs/reference/detector-parameters.md``'s table: every argument of every registered
    detector, its default, what it accepts (its declared constraint) and what it means (the
    class's ``Parameters`` docs)."""
    reg = REGISTRY if registry is None else registry
    rows = ["| detector | parameter | default | accepts | meaning |", "|---|---|---|---|---|"]
    for name in reg:
        cls = detector_class(name)
        det, docs = cls(), parameter_docs(cls)
        for arg, p in inspect.signature(cls).parameters.items():
            rule = cls.parameter_constraints.get(arg)
            accepts = _accepts(rule, det) if rule is not None else "checked by the class"
            rows.append(f"| `{name}` | `{arg}` | {_cell(_default(arg, p.default, rule))} | "
                        f"{_cell(accepts)} | {_cell(docs.get(arg, ''))} |")
    return "\n".join(rows)


#: file (relative to the repository root) -> its table
TABLES: dict[str, Callable[[], str]] = {
    "docs/concepts/detectors.md": detectors_table,
    "docs/CONTRACTS.md": contracts_table,
    "docs/reference/detector-parameters.md": parameters_table,
}


def render(text: str, table: str, where: str = "file") -> str:
    """``text`` with the lines between the markers replaced by ``table``.

    Raises
    ------
    ValueError
        If the markers are missing or out of order.
    """
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{where}: no '{BEGIN}' ... '{END}' markers.")
    return f"{text[:start]}{BEGIN}\n{table}\n{text[end:]}"


def stale_files(root: Path, *, write: bool = False) -> list[str]:
    """The files whose table differs from the generated one (rewritten with ``write``)."""
    stale = []
    for rel, make in TABLES.items():
        path = root / rel
        old = path.read_text(encoding="utf-8")
        new = render(old, make(), rel)
        if new != old:
            stale.append(rel)
            if write:
                path.write_text(new, encoding="utf-8")
    return stale


def main(argv: list[str] | None = None) -> int:
    """``python -m stability.config.registry_docs [--check] [--root DIR]``."""
    ap = argparse.ArgumentParser(prog="python -m stability.config.registry_docs",
                                 description="Regenerate the detector tables from the registry.")
    ap.add_argument("--check", action="store_true", help="only report stale files (exit 1)")
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[2])
    args = ap.parse_args(argv)
    stale = stale_files(args.root, write=not args.check)
    for rel in stale:
        print(f"{'stale' if args.check else 'rewrote'}: {rel}")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
