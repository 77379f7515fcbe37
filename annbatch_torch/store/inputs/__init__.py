"""AnnData inputs, for the writer and for in-place reading alike.

``open`` (what an input is, its name, opening it with damage named), ``legacy`` (anndata < 0.7
``.h5ad`` files decoded once), ``view`` (one input as both paths see it: probes and row
readers, :class:`~annbatch_torch.store.inputs.view.InputSource`), ``plan`` (a list of inputs:
duplicates, empties, shared names, the fields to offer), ``harmonize`` (the rules that make
fields of several inputs one), ``inplace`` (inputs read where they are, as a ``Source``),
``fingerprint`` (what identifies an input's content), ``mixture`` (several sources read as
one, in chosen proportions: ``mix`` and ``Mixture``).
"""
