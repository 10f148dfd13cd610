"""One file per layer kind. ``fastdp.layers`` imports every module of this package (alphabetical order), and their
``@register`` decorators add the kinds to :mod:`fastdp.layers.registry`: adding a layer type is adding a file here
with the kind's math and what it declares (:attr:`~fastdp.layers.base.LayerKind.refusals`,
:attr:`~fastdp.layers.base.LayerKind.doc`, :meth:`~fastdp.layers.base.LayerKind.oracle_cases`), then pasting
``python -c "from fastdp.layers.registry import docs_table; print(docs_table())"`` into the marked table of
docs/reference/layers.md. tests/layers/test_layer_kinds.py checks that every registered kind has oracle cases that match
the brute-force oracle in every clipping mode and a row in that table, and that every refusal rule is reported by
:mod:`fastdp.validate` and refused by the engine."""
