"""Transform passes: rewrite a traced graph into pipeline stages."""

from fxpipe.passes.rewrite.stages import split_stages

__all__ = ["split_stages"]
