"""Transformer Engine interop in one place: TE's own tensor classes (:mod:`.interop`:
``to_te`` / ``from_te``), TE's ``TensorSpec`` (:mod:`.spec`), and the ``_extra_state`` of TE modules
(:mod:`.extra_state`, decoded without unpickling). Each format's TE adapter (buffer names, TE's
quantizer fields) stays with the format, in ``te_serial/formats/``, as the rest of its rules do."""
