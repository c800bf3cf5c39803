"""The family-agnostic engine behind ``generate_flax.py``.

Mesh, placement, kernel routing, compile, benchmark protocol, staged intermediates, dry run
and report live here; nothing in this package names a model family. Families (``families/``)
plug in through ``families.ModelFamily``. README's "Layout" section maps the modules.
"""
