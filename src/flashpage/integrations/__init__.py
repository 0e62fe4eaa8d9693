"""Integrations of flashpage's kernels into other libraries (``transformers``)."""
