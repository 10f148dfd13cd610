"""One file per layer kind. Every module of this package is imported by ``fastdp.layers`` (alphabetical order), and
its ``@register`` decorators add its kinds to :mod:`fastdp.layers.registry`: adding a layer type is adding a file
here (its math, :attr:`~fastdp.layers.base.LayerKind.refusals`, :attr:`~fastdp.layers.base.LayerKind.doc` and
:meth:`~fastdp.layers.base.LayerKind.oracle_cases`), then regenerating the docs table
(``python -m fastdp.layers.registry``). tests/test_layer_kinds.py checks that every registered kind has oracle
cases that match the brute-force oracle in every clipping mode, and a row in docs/engine.md."""
