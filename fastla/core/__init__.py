"""Shared machinery: validation, varlen layout, gate math, references, dispatch."""
