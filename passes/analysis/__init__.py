"""Analysis passes: each writes one typed record under one node.meta key."""

from fxpipe.passes.analysis.shape import annotate_shapes

__all__ = ["annotate_shapes"]
