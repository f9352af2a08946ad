"""`qwen38 docs`: regenerate what the docs derive from the code (or check it has not drifted).

`.env.example` and the settings table of docs/settings.md are generated from the settings
fields, the README's profiles table from the profile files, the monitoring profile's Grafana
dashboard from `entrypoint.dashboard`; editing them by hand is a drift the tests catch.
"""

from __future__ import annotations

import re
from pathlib import Path

from core.errors import StackError
from core.profiles import render_profiles_table
from core.settings import render_env_example, render_settings_table
from entrypoint.dashboard import DASHBOARD_PATH, dashboard_json

REPO = Path(__file__).resolve().parent.parent


SETTINGS_DOC = REPO / "docs" / "settings.md"


def generated_sections(path: Path) -> dict[str, str]:
    """The generated blocks of one document (README.md or docs/settings.md), by marker name."""
    if path == SETTINGS_DOC:
        return {"settings-table": render_settings_table()}
    return {"profiles-table": render_profiles_table()}


def render_generated(path: Path, text: str) -> str:
    """``text`` (the document at ``path``) with each generated block between its markers renewed."""
    for name, table in generated_sections(path).items():
        pattern = rf"<!-- {name}:start -->\n.*?<!-- {name}:end -->"
        if not re.search(pattern, text, flags=re.S):
            raise StackError(f"{path.name}: markers <!-- {name}:start/end --> not found")
        text = re.sub(pattern, lambda _m: f"<!-- {name}:start -->\n{table}<!-- {name}:end -->", text, flags=re.S)
    return text


def render_readme(text: str) -> str:
    return render_generated(REPO / "README.md", text)


def generated_targets() -> dict[Path, str]:
    """Every file `qwen38 docs` derives from the code -> the content it should have."""
    return {
        REPO / ".env.example": render_env_example(),
        REPO / "README.md": render_readme((REPO / "README.md").read_text()),
        SETTINGS_DOC: render_generated(SETTINGS_DOC, SETTINGS_DOC.read_text()),
        DASHBOARD_PATH: dashboard_json(),
    }


def stale_targets(targets: dict[Path, str]) -> list[Path]:
    """The files of ``targets`` missing or with other content than generated."""
    return [path for path, content in targets.items() if not path.is_file() or path.read_text() != content]
