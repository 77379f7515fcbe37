"""Integrations with other libraries, each imported lazily by its user and built on the
public API only; nothing in the core imports this package. ``scvi``: scvi-tools models
(SCVI, SCANVI) trained from a collection."""
