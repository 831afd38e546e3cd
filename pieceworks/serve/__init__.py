"""`pieceworks serve` (an OpenAI-compatible HTTP server over `AsyncEngine`) and `pieceworks bench`.

Needs the `serve` extra (`pip install 'pieceworks[serve]'`: fastapi, uvicorn, httpx). `build_app` is
the reference for embedding pieceworks in a server of one's own.
"""

from __future__ import annotations

from typing import Any

__all__ = ["build_app", "TOOL_CALL_PARSERS", "REASONING_PARSERS"]

#: The formats `--tool-call-parser` reads tool calls in (serve/tools.py); here, so the CLI needs no pydantic.
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "deepseek_v3", "deepseek_v31", "glm45", "qwen3_coder",
                     "seed_oss")
#: The formats `--reasoning-parser` splits a thinking model's answer by (serve/reasoning.py).
REASONING_PARSERS = ("deepseek_r1", "qwen3", "glm45", "seed_oss")


def __getattr__(name: str) -> Any:
    if name == "build_app":
        from pieceworks.serve.app import build_app

        return build_app
    raise AttributeError(f"module 'pieceworks.serve' has no attribute {name!r}")
