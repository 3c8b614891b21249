"""The reference pages name every config key and every CLI option the code accepts.

``docs/reference/configuration.md`` has one section per config table (its heading names the
table, e.g. ``[policy.lr]``); each key of that table's dataclass must appear in it as
```key```.  ``docs/reference/cli.md`` has one section per subcommand; each option string of the
subcommand's parser must appear in it.  A key or option added without documentation fails here.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from replay.cli import build_parser
from stability.config.config import DetectorSpec
from stability.config.sections import AlertsConfig, EventLogConfig, MonitorSettings, WebhookConfig
from stability.policy.config import (
    ClipConfig,
    KindRule,
    LRConfig,
    LRJumpConfig,
    PolicyConfig,
    RecoveryConfig,
)
from stability.policy.lr_guard import LRGuardConfig

DOCS = Path(__file__).resolve().parents[1] / "docs" / "reference"

#: heading text that opens a section -> the dataclass whose fields it must list
SECTIONS = {
    "`[monitor]`": MonitorSettings,
    "`[[detectors]]`": DetectorSpec,
    "`[policy]`": PolicyConfig,
    "`[policy.clip]`": ClipConfig,
    "`[policy.lr]`": LRConfig,
    "`[policy.lr_guard]`": LRGuardConfig,
    "`[policy.lr_jump]`": LRJumpConfig,
    "`[policy.recovery]`": RecoveryConfig,
    "`[policy.kinds.<kind>]`": KindRule,
    "`[alerts]` and `[event_log]`": (AlertsConfig, WebhookConfig, EventLogConfig),
}


def _sections(text: str) -> dict[str, str]:
    """Heading text -> the text up to the next heading of any level."""
    parts = re.split(r"^#{2,4} (.+)$", text, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


@pytest.mark.parametrize("heading", sorted(SECTIONS))
def test_configuration_reference_lists_every_key(heading: str) -> None:
    sections = _sections((DOCS / "configuration.md").read_text(encoding="utf-8"))
    assert heading in sections, f"configuration.md: no section '{heading}'"
    classes = SECTIONS[heading]
    for cls in classes if isinstance(classes, tuple) else (classes,):
        missing = [f.name for f in dataclasses.fields(cls)
                   if f"`{f.name}`" not in sections[heading]]
        assert not missing, f"configuration.md, {heading}: keys not documented: {missing}"


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in build_parser()._actions
                  if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("name", sorted(_subcommands()))
def test_cli_reference_lists_every_option(name: str) -> None:
    sections = _sections((DOCS / "cli.md").read_text(encoding="utf-8"))
    heading = f"`stability {name}`"
    assert heading in sections, f"cli.md: no section '{heading}'"
    parser = _subcommands()[name]
    missing = [opt for a in parser._actions if not isinstance(a, argparse._HelpAction)
               for opt in a.option_strings if f"`{opt}" not in sections[heading]]
    assert not missing, f"cli.md, {heading}: options not documented: {missing}"


def test_the_checks_see_a_missing_key() -> None:
    text = "## `[policy.lr]`\n| `factor` |\n## next\n"
    section = _sections(text)["`[policy.lr]`"]
    assert "`factor`" in section and "`duration`" not in section
