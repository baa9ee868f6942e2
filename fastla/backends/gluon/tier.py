"""Registers the Gluon (sm_90) kernels with the dispatcher."""
from fastla.backends.gluon import chunk_delta
from fastla.core import dispatch

dispatch.register("chunk_gated_delta_rule", "gluon", chunk_delta.supports)(chunk_delta.run)
