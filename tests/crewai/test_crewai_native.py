"""With crewai's own guard (the upstream patch in patches/) the plugin stands down."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def test_plugin_stands_down_when_crewai_guards_tools_natively() -> None:
    script = textwrap.dedent(
        """
        import warnings
        from pydantic.fields import FieldInfo
        from crewai.tools.base_tool import BaseTool
        # what the upstream patch adds to BaseTool
        BaseTool.__pydantic_fields__["idempotent"] = FieldInfo(annotation=bool, default=False)
        import crewai_idempotent.integration as integration
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            integration.install()
        assert not integration.is_installed(), "installed over a native guard"
        assert any("stands down" in str(w.message) for w in caught), caught
        print("stood down")
        """
    )
    env = {**os.environ, "CREWAI_IDEMPOTENT_AUTOLOAD": "0"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "stood down" in done.stdout
