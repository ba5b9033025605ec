"""The two ways conversation keying fails: at load (config) and per request (render)."""

from __future__ import annotations

from typing import Literal

__all__ = ["RENDER_REASONS", "RenderError", "RenderReason", "TemplateLoadError"]

RenderReason = Literal["non_text", "invalid", "unsupported", "template", "error"]
RENDER_REASONS: tuple[RenderReason, ...] = (
    "non_text",
    "invalid",
    "unsupported",
    "template",
    "error",
)
"""Why a request has no chain (the label of the failure counters):

* ``non_text``: an image, audio, video or file part (the engine's prompt has media tokens
  the router cannot render);
* ``invalid``: a request vLLM itself would reject (malformed messages or tools, both
  ``add_generation_prompt`` and ``continue_final_message``, ...);
* ``unsupported``: valid for the engine but not renderable here (a per-request
  ``chat_template``);
* ``template``: the template refused the conversation (its own ``raise_exception``);
* ``error``: any other failure while rendering (an undefined name, a type error in the
  template, a sandbox violation).
"""


class RenderError(Exception):
    """A request that cannot be rendered; it is routed on its prefix key instead."""

    def __init__(self, reason: RenderReason, detail: str) -> None:
        self.reason: RenderReason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}")


class TemplateLoadError(Exception):
    """A configured template file that does not load; ``field`` names the config field
    (``tokenizer_config``, ``chat_template`` or ``tokenizer``) whose file is at fault."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")
