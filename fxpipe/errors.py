"""The exceptions fxpipe raises for mistakes a user can fix."""

from __future__ import annotations

__all__ = ["FxpipeError", "FxpipeTraceError", "PlanError"]


class FxpipeError(ValueError):
    """A request fxpipe cannot carry out; the message says what to change."""


class PlanError(FxpipeError):
    """A Plan, or a Plan together with a model, asks for something impossible."""


class FxpipeTraceError(FxpipeError):
    """No tracing frontend could turn the model into a graph."""
