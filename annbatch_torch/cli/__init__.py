"""The ``annbatch-torch`` command.

Modules:

- ``main``: the commands (``shuffle``, ``append``, ``info``, ``diversity``, ``demo``,
  ``bench``), the parser
  and :func:`main`, the entry point with its one-line error reports;
- ``args``: the flag-to-parameter framework (:class:`~.args.CliParser`, ``Feed``): flags that
  feed the library's parameters, and the library's messages rewritten to those flags;
- ``info``: ``annbatch-torch info``, the summary of a collection or an AnnData input;
- ``diversity``: ``annbatch-torch diversity``, the shuffle-quality report of a collection under
  loader settings (obs only);
- ``demo``: ``annbatch-torch demo``, the main job end to end on generated data.

The command's entry point is :func:`annbatch_torch.cli.main.main`; ``python -m
annbatch_torch.cli`` (``__main__``) and ``python -m annbatch_torch`` run it too. Nothing is
imported here, so that ``annbatch_torch.cli.main`` names the module, not the function.
"""
