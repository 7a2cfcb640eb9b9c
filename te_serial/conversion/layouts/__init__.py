"""The serving layouts te-serial writes and reads, one module each: NVIDIA ModelOpt
(:mod:`.modelopt`), compressed-tensors (:mod:`.compressed_tensors`), DeepSeek-V3 block FP8
(:mod:`.deepseek`) and gpt-oss MXFP4 (:mod:`.gpt_oss`). Each says which weight schemes it holds, how a weight's tensors are named and
laid out, what ``config.json`` (and ``hf_quant_config.json``) say, and how its reader applies the
scales; :mod:`.base` holds what they share."""

from __future__ import annotations

from .base import SCHEMES, CodesCheck, codes_check, representation, ulp_distance, ulp_histogram
from .common import ACTIVATION_MODES, SIDECAR_NAME, ExternalLayout
from .compressed_tensors import CompressedTensors
from .deepseek import DeepSeek
from .gpt_oss import GptOss
from .modelopt import ModelOpt

#: family → layout
FAMILIES: dict[str, ExternalLayout] = {"modelopt": ModelOpt(), "ct": CompressedTensors(), "deepseek": DeepSeek(),
                                       "gpt_oss": GptOss()}

