"""What the installed crewai release has: tests of a path a release lacks skip, naming it.

Feature checks, not version comparisons, except in the skip reasons (which say which
release added the path, from docs/compatibility.md).
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Any

import pytest

CREWAI = importlib.metadata.version("crewai")


def _importable(module: str, name: str | None = None) -> bool:
    try:
        found = importlib.import_module(module)
    except ImportError:
        return False
    return name is None or hasattr(found, name)


HAS_FLOW_TOOL_ACTIONS = _importable("crewai.flow.runtime._actions", "ToolAction") and _importable(
    "crewai.flow.flow_definition", "FlowToolActionDefinition"
)
HAS_STEP_EXECUTOR = _importable("crewai.agents.step_executor", "StepExecutor")
HAS_FORMATTED_DESCRIPTION = _importable("crewai.tools.base_tool") and hasattr(
    importlib.import_module("crewai.tools.base_tool").BaseTool, "formatted_description"
)
HAS_TOOL_FAILURE = _importable("crewai.tools.tool_failure", "ToolFailure")


def _class(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


# crewai's two agent executors: CrewAgentExecutor (the default up to 1.14.4, removed in
# 1.15.29) and the flow-based AgentExecutor (crewai.experimental until 1.15.28).
CREW_AGENT_EXECUTOR = _class("crewai.agents.crew_agent_executor", "CrewAgentExecutor")
AGENT_EXECUTOR = _class("crewai.agents.agent_executor", "AgentExecutor") or _class(
    "crewai.experimental.agent_executor", "AgentExecutor"
)
EXECUTORS = {
    name: cls
    for name, cls in (
        ("crew_agent_executor", CREW_AGENT_EXECUTOR),
        ("agent_executor", AGENT_EXECUTOR),
    )
    if cls is not None
}


def skip_unless(present: bool, what: str, since: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        not present, reason=f"crewai {CREWAI} has no {what} (added in crewai {since})"
    )
