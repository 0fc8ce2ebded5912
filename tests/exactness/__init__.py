"""The exactness conformance matrix (see :mod:`exactness.matrix`)."""
