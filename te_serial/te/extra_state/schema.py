"""What TE's extra state is made of -- its recipe classes, enums, namedtuples, state keys and
storage dtypes -- and the value rules that the decoder, the checker and the encoder all apply."""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

RECIPE_MODULE = "transformer_engine.common.recipe"
RECIPE_CLASSES = frozenset({
    "Recipe", "DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling",
    "Float8BlockScaling", "NVFP4BlockScaling", "CustomRecipe", "MMParams", "QParams",
})  # fmt: skip
"""Classes of ``transformer_engine.common.recipe`` rebuilt as ``NEWOBJ(cls, ()) + BUILD(dict)``."""
RECIPE_NAMEDTUPLES: Dict[str, Tuple[str, ...]] = {
    "_FormatHelper": ("max_fwd", "max_bwd"),
    "_OverrideLinearPrecision": ("fprop", "dgrad", "wgrad"),  # DelayedScaling field up to TE 2.x
}
"""NamedTuples of the recipe module (``NEWOBJ(cls, values)``) and their field names."""
_FORMAT_MEMBERS: Dict[Tuple[Any, Any], str] = {
    (6, 6): "E2M1", (448, 448): "E4M3", (57344, 57344): "E5M2", (448, 57344): "HYBRID",
}  # fmt: skip
RECIPE_ENUMS = {"Format": _FORMAT_MEMBERS}
STATELESS_RECIPES = frozenset({"Float8CurrentScaling", "MXFP8BlockScaling", "Float8BlockScaling",
                                "NVFP4BlockScaling"})
KNOWN_RECIPE_POLICIES = STATELESS_RECIPES | {"DelayedScaling", "CustomRecipe"}

DELAYED_SCALING_KEYS = ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd")

STORAGE_DTYPES: Dict[str, torch.dtype] = {
    "FloatStorage": torch.float32, "HalfStorage": torch.float16, "BFloat16Storage": torch.bfloat16,
    "ByteStorage": torch.uint8, "CharStorage": torch.int8, "ShortStorage": torch.int16,
    "IntStorage": torch.int32, "LongStorage": torch.int64, "BoolStorage": torch.bool,
}  # fmt: skip

SCALARS = (type(None), bool, int, float, str, bytes)
SCALAR_SET = frozenset(SCALARS)
_INTS = frozenset({int, bool})


def widest_int(values: Any) -> int:
    """Bits of the widest int among scalars (C speed when they are all ints / bools)."""
    types = set(map(type, values))
    if int not in types:
        return 0
    if types <= _INTS:
        return max(max(values).bit_length(), min(values).bit_length())
    return max(x.bit_length() for x in values if type(x) is int)


def bad_field_name(name: Any) -> bool:
    """Recipe instance-dict keys must be plain identifiers; never dunders (``__reduce_ex__`` in an
    instance dict would be called by ``pickle.dumps``; ``__class__`` / ``__dict__`` are not
    fields)."""
    return type(name) is not str or not name.isidentifier() or (
        name.startswith("__") and name.endswith("__"))
