"""Recipe conversion, and importers/exporters for other checkpoint layouts.

``te_serial.convert(src, dst, recipe=...)`` (this package's :func:`convert`) converts any checkpoint
te-serial reads — te-serial, plain Hugging Face safetensors, ModelOpt, compressed-tensors,
DeepSeek-V3 block FP8 — into any recipe or layout it writes, one tensor at a time, and returns
a :class:`ConversionReport` saying per tensor whether the values were kept exactly ("lossless")
or changed ("lossy", with max abs error, relative RMSE and SNR).
"""

from __future__ import annotations

from .calibrate import ActivationAmax
from .core import ExportSpec, TensorPlan, convert, plan_conversion
from .layouts import codes_check, ulp_histogram
from .report import EXACT_CODES, ConversionReport, TensorReport
from .sources import LAYOUTS, Source, SourceTensor, detect_layout, open_source
from .targets import DEFAULT_KEEP_PATTERNS, KEEP, TARGETS, Rules, Target, load_rules, target, target_names
from .transforms import compare, values


def estimate_bytes(path, recipe: str | None, *, rules=None, usages=None) -> dict[str, int]:
    """Bytes each tensor of the checkpoint at ``path`` would take after ``convert(..., recipe)``
    (from the plan alone: nothing is read but headers and manifests)."""
    with open_source(path) as src:
        _, _, plans = plan_conversion(src, recipe=recipe, rules=rules, usages=usages)
        return {p.name: p.nbytes for p in plans}
