"""Graph passes: analysis (graph -> annotations) and transforms (graph -> graph)."""
