"""Hugging Face ``from_pretrained`` for te-serial: ``import te_serial.hf`` registers the ``te_serial``
quantization method with transformers (5.x), so that

```python
import te_serial.hf
from te_serial.hf import TeSerialConfig
model = AutoModelForCausalLM.from_pretrained("llama-mxfp8/")            # a te-serial checkpoint directory
model = AutoModelForCausalLM.from_pretrained("llama-bf16/", quantization_config=TeSerialConfig(recipe="nvfp4"))
```

load through transformers' own loop, with the bytes :func:`te_serial.load_into` and
:func:`te_serial.quantize_model` give. Importing ``te_serial.hf`` is what registers; without it,
transformers logs "Unknown quantization type, got te_serial" and then fails to find
``model.safetensors`` (a te-serial directory's weight index has its own name, :data:`HF_INDEX_NAME`),
rather than loading the buffers as unexpected keys beside randomly initialized weights. A
``config.json`` ``save_quantized`` writes carries :data:`HF_INSTALL_HINT` as its ``transformers_weights``:
transformers without te-serial refuses that value (it names no weight file) with a ValueError that
quotes it, before it looks for weights; ``te_serial.hf`` replaces it with :data:`HF_INDEX_NAME`.

How a te-serial checkpoint loads (``TeSerialHfQuantizer``, pre-quantized):

* ``update_attn_implementation(config)`` — the one hook that sees the config before transformers
  looks for weight files — points ``config.transformers_weights`` to :data:`HF_INDEX_NAME`, which
  ``save_quantized`` writes beside ``config.json`` (the pointer is removed from ``model.config``
  again before any weight is read);
* ``_process_model_before_weight_loading(model, checkpoint_files=...)`` opens the checkpoint once
  with ``te_serial.open`` (manifest and schema checked: an unknown quantizer kind or a newer format
  is te-serial's ``ManifestError`` / ``VersionError`` here, before any buffer is read; each shard's
  header is checked against the manifest at its first read), and derives from the manifest's prototypes which safetensors keys are whose;
* from a hub repository, transformers downloads only the files the weight index names, into a
  huggingface_hub cache snapshot (``<cache>/models--org--name/snapshots/<commit>/``); the manifest is
  then fetched into the same snapshot with transformers' ``cached_file``, at the commit and cache read
  off the shards' path (a ``token=``, ``proxies=`` or ``local_files_only=`` given to from_pretrained
  does not reach a quantizer: huggingface_hub's own settings apply). The snapshot's files are
  symlinks into the repository's ``blobs/``: te-serial's reader, which follows no link inside a
  checkpoint, follows these to that folder and nowhere else (``Checkpoint(links_into=...)``);
* ``serialized_names`` makes transformers collect, for each quantized weight, the keys of its
  small buffers (scales, amax: every buffer but the data) into one ``WeightConverter`` whose
  deserialize op, ``TeSerialDeserialize``, returns ``Checkpoint.get(name, device=...)``: the tensor
  te-serial's own reader builds, as ``load_into`` does (on CPU the file's mmap'd pages), with the
  model's dtype as its nominal dtype and the saved ``requires_grad``;
* the data buffers — nearly all the bytes — match no converter, so transformers never materializes
  them (it would copy them, on its worker threads, before any op runs: ops only ever see
  materialized tensors); ``model._keys_to_ignore_on_load_unexpected`` keeps them out of the load
  report. Only the small buffers are read twice (by transformers, then by te-serial).

Every parameter still passes through transformers' loop (``set_param_for_module``), so it is marked
loaded and never re-initialized; plain tensors (norms, embeddings, heads) load as transformers loads
them, non-persistent buffers (rotary ``inv_freq``) are initialized by transformers, tied weights are
tied by transformers. Handing the buffers transformers materialized to te-serial to assemble would be
simpler, but every byte would then go through transformers' copy (a copy per buffer, no mmap on CPU)
and not through te-serial's reader; this way the data is read once, by te-serial.

Quantize on load (``from_pretrained(bf16_dir, quantization_config=TeSerialConfig(recipe=...))``):
``param_needs_quantization`` holds exactly the weights :func:`te_serial.quantize_model` quantizes —
``nn.Linear`` weights and 3-D expert stacks outside :func:`te_serial.precision.stays_high_precision`
(``te_serial.model.choose_weights``, the one choice) — less the modules the
config's ``exclude`` globs name; a weight the recipe's shape rule refuses stays in high precision with
quantize_model's warning naming it. ``TeSerialQuantize`` quantizes each weight as transformers hands
it over (one tensor at a time). For a recipe whose scale is tensor-wide (per-tensor FP8 current
scaling, NVFP4's global scale), the members of a fused group (q/k/v, gate/up: :mod:`te_serial.fusion`)
take quantize_model's shared amax: the first member quantized reads its group partners from the
checkpoint files (cast to the load dtype, as transformers casts them) and computes it with
quantize_model's own code; the partners then use it, so a group costs one extra read of its members.

Checkpoints te-serial reads itself (``_read_itself``): quantized per-expert tensors (a ``te-serial
convert`` output, a transformers-4-style MoE) that the model holds as 3-D experts, and quantized
layouts of other tools — ``from_pretrained(dir, quantization_config=TeSerialConfig(...))`` of a
DeepSeek FP8, ModelOpt or compressed-tensors directory. transformers would merge quantized bytes or
give the layout to its own quantizer (it refuses two configs: ``te_serial.hf`` wraps its
``merge_quantization_configs`` so that a ``TeSerialConfig`` passed for another layout's checkpoint is
taken, the layout's quant_method kept in ``source_method``). te-serial opens the directory with
:func:`te_serial.conversion.sources.open_source` (the importers ``convert`` and ``load_into`` use), sees
it under the model's names (per-expert tensors joined exactly into grouped 3-D experts, or refused
naming the block rule), and plans each tensor as ``load_into`` does: what the layout holds
quantized keeps its values (``TeSerialConfig()``), or goes to the config's recipe exactly where the
bytes allow (``TeSerialConfig(recipe=...)``), with the recipe's choice of weights quantized on the
way in. ``SourceKeys``, a converter placed before the model's own, routes each such tensor's file keys
by lookup: one small key per tensor triggers ``TeSerialRead`` (te-serial's tensor, on the device
transformers reads that key to), a key with the parameter's own name is sent to it unread, the rest
go nowhere (:data:`HELD_KEY`). transformers reads no quantized data and builds no BF16 copy of the
experts; plain tensors load through transformers as usual.

``model.save_pretrained`` of a loaded model writes a te-serial directory (``te_serial.model``'s
``_te_serial_save_pretrained``: ``save_quantized`` plus ``generation_config.json``), which loads back
to the same bytes. Not in this module: disk offload.
"""

from __future__ import annotations

import copy
import fnmatch
import re
import warnings
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

try:
    import transformers
    from transformers.core_model_loading import ConversionOps, WeightConverter, WeightRenaming, apply_renamings
    from transformers.quantizers.auto import (AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING,
                                              register_quantization_config, register_quantizer)
    from transformers.quantizers.base import HfQuantizer
    from transformers.utils.quantization_config import QuantizationConfigMixin
except ImportError as e:  # transformers is optional: only this module needs it
    raise ImportError("te_serial.hf needs transformers 5 or later (pip install 'te-serial[hf]')") from e

from . import fusion
from .checkpoint.files import release_pages
from .checkpoint.manifest import MANIFEST_NAME, VERSION, expected_buffers
from .checkpoint.reader import Checkpoint
from .conversion.sources import TeSerialSource
from .checkpoint.writer import HF_INDEX_NAME, HF_INSTALL_HINT, QUANT_METHOD, quantization_config
from .errors import CheckpointError, ConversionError, FormatError, UnsupportedOperationError
from .formats.tensors import QuantizedTensorStorage
from .model import (as_model_names, choose_weights, chosen_linears, guard_save_pretrained, model_config_dict,
                    plan_load, read_for_model, shared_amax, tensor_slots, with_nominal)
from .proto import TensorProto, to_tensor_proto
from .recipes import RECIPES, recipe_quantizer

__all__ = ["TeSerialConfig", "TeSerialHfQuantizer", "QUANT_METHOD", "HF_INDEX_NAME"]

if int(transformers.__version__.split(".")[0]) < 5:
    raise ImportError(f"te_serial.hf needs transformers 5 or later, found {transformers.__version__}")

_USAGES = ("rowwise", "columnwise")
_FIELDS = ("recipe", "exclude", "usages", "fused", "format_version", "modules")
#: where the checkpoint keys te-serial reads itself are sent in transformers' loop: no parameter,
#: so transformers never reads them (and they are kept out of its "unexpected" report)
HELD_KEY = "te_serial:held"
_TRANSFORMERS_MERGE: Any = None   # transformers' own merge_quantization_configs, which ours wraps


class TeSerialConfig(QuantizationConfigMixin):
    """``quantization_config`` of the ``te_serial`` method (what ``config.json`` holds).

    For quantize on load: ``recipe`` (a name in :data:`te_serial.recipes.RECIPES`); ``exclude``
    (module-name globs kept in high precision, in addition to te-serial's one rule,
    :func:`te_serial.precision.stays_high_precision`); ``usages`` (``["rowwise"]`` for inference,
    ``["rowwise", "columnwise"]`` for training; None: as ``quantize_model`` decides, columnwise under
    grad mode); ``fused`` (as ``quantize_model(fused=...)``: ``"auto"``, ``"off"`` or groups of module
    names). A checkpoint ``save_quantized`` wrote also records ``format_version`` and, per quantized
    module, its recipe name (or its quantizer's fields) in ``modules``; its manifest stays the
    authority, and ``from_pretrained`` refuses a ``config.json`` whose ``modules`` disagree with it.
    """

    def __init__(self, recipe: str | None = None, exclude: Sequence[str] | None = None,
                 usages: Sequence[str] | None = None, fused: str | Sequence[Sequence[str]] | None = "auto",
                 format_version: str | None = None, modules: dict[str, Any] | None = None,
                 quant_method: str = QUANT_METHOD, **unknown: Any) -> None:
        if quant_method != QUANT_METHOD:
            raise FormatError(f"TeSerialConfig is quant_method {QUANT_METHOD!r}, got {quant_method!r}")
        if unknown:  # a newer te-serial's fields: the manifest decides what loads, so say and go on
            warnings.warn(f"te-serial: quantization_config fields {sorted(unknown)} are unknown to this version "
                          "and ignored", stacklevel=2)
        self.quant_method = QUANT_METHOD
        self.recipe = recipe
        self.exclude = list(exclude) if exclude is not None else None
        self.usages = list(usages) if usages is not None else None
        self.fused = fused if fused is None or isinstance(fused, str) else [list(g) for g in fused]
        self.format_version = format_version if format_version is not None else f"{VERSION[0]}.{VERSION[1]}"
        self.modules = dict(modules) if modules is not None else None
        #: the quant_method of the checkpoint's own config.json when it is another layout's (set by
        #: from_pretrained, see :func:`_merge_quantization_configs`); not saved
        self.source_method: str | None = None
        self.post_init()

    def post_init(self) -> None:
        if self.recipe is not None and self.recipe not in RECIPES:
            raise FormatError(f"unknown recipe {self.recipe!r}; choose one of {', '.join(RECIPES)}")
        if self.exclude is not None and not all(isinstance(p, str) for p in self.exclude):
            raise FormatError(f"exclude must be module-name globs, got {self.exclude!r}")
        if self.usages is not None and (not self.usages or set(self.usages) - set(_USAGES)):
            raise FormatError(f"usages must name one or both of {list(_USAGES)}, got {self.usages!r}")
        fusion.groups_for(None, self.fused)  # refuses what quantize_model(fused=...) refuses
        if not isinstance(self.format_version, str) or not re.fullmatch(r"\d+\.\d+", self.format_version):
            raise FormatError(f"format_version must read 'major.minor', got {self.format_version!r}")
        if self.modules is not None and not all(isinstance(k, str) and isinstance(v, (str, dict))
                                                for k, v in self.modules.items()):
            raise FormatError("modules maps module names to a recipe name or a quantizer's fields")

    def to_dict(self) -> dict[str, Any]:
        return {"quant_method": QUANT_METHOD, **{f: copy.deepcopy(getattr(self, f)) for f in _FIELDS}}


def _matches(name: str, patterns: Sequence[str] | None) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns or ())


def _hub_snapshot(folder: Path) -> tuple[Path, str, str, str] | None:
    """(repository folder, repo id, commit, subfolder) of a folder inside a huggingface_hub cache
    snapshot, ``<cache>/models--org--name/snapshots/<commit>/[subfolder]``, where transformers puts
    the files it downloads; None for any other folder."""
    from huggingface_hub.constants import REPO_ID_SEPARATOR
    from huggingface_hub.file_download import REGEX_COMMIT_HASH, repo_folder_name
    parts = folder.parts
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] != "snapshots" or not REGEX_COMMIT_HASH.fullmatch(parts[i + 1]):
            continue
        kind, _, name = parts[i - 1].partition(REPO_ID_SEPARATOR)
        repo_id = name.replace(REPO_ID_SEPARATOR, "/")
        if kind == "models" and name and repo_folder_name(repo_id=repo_id, repo_type="model") == parts[i - 1]:
            return Path(*parts[:i]), repo_id, parts[i + 1], "/".join(parts[i + 2:])
    return None


class _Op(ConversionOps):
    """An op that holds the quantizer by reference: transformers deep-copies a converter per weight,
    and the quantizer holds the open checkpoint."""

    def __init__(self, hf_quantizer: "TeSerialHfQuantizer") -> None:
        self.hf_quantizer = hf_quantizer

    def __deepcopy__(self, memo: dict) -> "_Op":
        return type(self)(self.hf_quantizer)

    @property
    def reverse_op(self) -> ConversionOps:
        raise UnsupportedOperationError("te-serial tensors are saved by te_serial.save_quantized, not save_pretrained")


class TeSerialDeserialize(_Op):
    """One quantized weight of a te-serial checkpoint, read by te-serial's reader. ``input_dict``
    holds the weight's small buffers as transformers materialized them (only their device is used:
    it is where transformers places the parameter)."""

    def convert(self, input_dict: dict, full_layer_name: str | None = None, model: nn.Module | None = None,
                **kwargs: Any) -> dict[str, nn.Parameter]:
        first = next(iter(input_dict.values()))
        device = (first[0] if isinstance(first, list) else first).device
        return {full_layer_name: self.hf_quantizer._read_quantized(full_layer_name, device, model)}


class TeSerialRead(_Op):
    """One model tensor of a checkpoint te-serial reads through its own importers (a layout
    transformers would read otherwise, per-expert quantized experts): what ``load_into`` gives,
    read when transformers reaches the tensor's one trigger key (``input_dict``: that key's tensor,
    of which only the device is used)."""

    def convert(self, input_dict: dict, full_layer_name: str | None = None, model: nn.Module | None = None,
                **kwargs: Any) -> dict[str, nn.Parameter]:
        first = next(iter(input_dict.values()))
        device = (first[0] if isinstance(first, list) else first).device
        return {full_layer_name: self.hf_quantizer._read_source(full_layer_name, device, model)}


TRIGGER, NAMED, HELD = 0, 1, 2   # how SourceKeys routes a key (its source pattern's index)


class SourceKeys(WeightConverter):
    """The checkpoint keys te-serial reads itself, routed by lookup before the model's own
    converters (a per-expert merge or a rename never sees them). ``route``: key (as the model's
    renamings leave it) → (parameter, TRIGGER) for the one small key per tensor whose read tells
    the parameter's device; (parameter, NAMED) for a key that has the parameter's own name (its
    data: sent to the parameter, or transformers would load it as the weight, and never read);
    (:data:`HELD_KEY`, HELD) for the rest, which transformers reads nowhere."""

    def __init__(self, hf_quantizer: "TeSerialHfQuantizer", route: dict[str, tuple[str, int]]) -> None:
        super().__init__(["te_serial:trigger", "te_serial:named", HELD_KEY], "te_serial:read",
                         [TeSerialRead(hf_quantizer)])
        self.route = route

    def __deepcopy__(self, memo: dict) -> "SourceKeys":  # one per parameter: the table is shared
        return SourceKeys(self.operations[0].hf_quantizer, self.route)

    def rename_source_key(self, source_key: str) -> tuple[str, str | None]:
        found = self.route.get(source_key)
        if found is None:
            return source_key, None
        self._was_used = True
        return found[0], self.source_patterns[found[1]]

    def materialize_tensors(self) -> dict[str, list[torch.Tensor]]:
        self.collected_tensors.pop(self.source_patterns[NAMED], None)  # deferred reads, never run
        return super().materialize_tensors()


class TeSerialQuantize(_Op):
    """One high-precision weight, quantized as transformers hands it over."""

    def convert(self, input_dict: dict, full_layer_name: str | None = None, model: nn.Module | None = None,
                **kwargs: Any) -> dict[str, nn.Parameter]:
        (key, value), = input_dict.items()
        value = value[0] if isinstance(value, list) else value
        out = {key: self.hf_quantizer._quantize(key, value, model)}
        release_pages(value)  # the source file's pages, read: the process holds only what it loaded
        return out


class TeSerialHfQuantizer(HfQuantizer):
    """transformers' quantizer for the ``te_serial`` method (see the module docstring)."""

    requires_calibration = False
    quantization_config: TeSerialConfig

    def __init__(self, quantization_config: TeSerialConfig, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        self._ckpt: Checkpoint | None = None
        self._serialized: dict[str, list[str]] = {}
        self._to_quantize: dict[str, tuple] = {}      # weight name → (module name, its quantizer): quantize on load
        self._group_of: dict[str, tuple[str, ...]] = {}  # module → its fused group (tensor-wide scales)
        self._amax: dict[str, Any] = {}                # module → its group's shared amax, once computed
        self._files: list[str] = []
        self._key_files: dict[str, str] | None = None
        self._q = None
        # a checkpoint te-serial reads through its own importers (read_itself)
        self._source = None                              # the source, as the model names its tensors
        self._steps: dict[str, Any] = {}                 # name → load step (None: as it is)
        self._file_keys: dict[str, list[str]] = {}       # name → the file keys holding it
        self._dropped_keys: list[str] = []               # file keys the importer sets aside (activation scales)
        self._chosen: set[str] = set()                   # names quantized to the recipe on the way in

    # --- before the model is built ----------------------------------------------------------------
    def validate_environment(self, *args: Any, device_map: Any = None, **kwargs: Any) -> None:
        if isinstance(device_map, dict) and "disk" in device_map.values():
            raise UnsupportedOperationError("te_serial.hf does not offload to disk; use device_map='cpu' or 'auto' "
                                            "without disk")

    def update_attn_implementation(self, config: Any) -> Any:
        # the only hook that sees the config before transformers looks for the weight files; the
        # install hint a te-serial config.json carries there (HF_INSTALL_HINT) is for transformers alone
        if self.pre_quantized and self.quantization_config.source_method is None \
                and getattr(config, "transformers_weights", None) in (None, HF_INSTALL_HINT):
            config.transformers_weights = HF_INDEX_NAME
        return config

    # --- the model on meta, before any weight is read -----------------------------------------------
    def _process_model_before_weight_loading(self, model: nn.Module, checkpoint_files: list[str] | None = None,
                                             **kwargs: Any) -> nn.Module:
        if getattr(model.config, "transformers_weights", None) == HF_INDEX_NAME:
            del model.config.transformers_weights  # our pointer, not the model's config
        with torch.device("cpu"):  # transformers calls this under its meta-device init context
            if self.pre_quantized and self.quantization_config.source_method is None:
                self._open(model, checkpoint_files)
            else:
                self._plan(model, checkpoint_files)
        return model

    def _open(self, model: nn.Module, checkpoint_files: list[str] | None) -> None:
        if not checkpoint_files or not all(str(f).endswith(".safetensors") for f in checkpoint_files):
            raise CheckpointError("a te-serial checkpoint loads from its safetensors shards (through "
                                  f"{HF_INDEX_NAME}); transformers found {checkpoint_files!r}")
        root = Path(checkpoint_files[0]).parent
        snapshot = _hub_snapshot(root)
        if snapshot is not None:
            self._hub_manifest(root, *snapshot)
        elif not (root / MANIFEST_NAME).is_file():
            raise CheckpointError(f"config.json says quant_method {QUANT_METHOD!r}, but there is no {MANIFEST_NAME} "
                                  "beside the shards (save_quantized writes it; copy the whole directory)",
                                  file=str(root))
        # a hub snapshot's files are symlinks to its repository's blobs: followed there, and only there
        ckpt = Checkpoint(root, links_into=snapshot[0] / "blobs" if snapshot is not None else None)
        try:
            stray = sorted({Path(f).name for f in checkpoint_files} - set(ckpt.manifest.files))
            if stray:
                raise CheckpointError(f"{HF_INDEX_NAME} names shards {stray[:5]} that {MANIFEST_NAME} does not "
                                      "(save the checkpoint again)", file=str(root))
            quantized = {n: p for n, p in ckpt.protos.items() if p.quantizer is not None}
            self._check_modules(quantized, root)
            if self._read_itself(model, TeSerialSource(root, ckpt=ckpt), root, as_saved=True):
                return  # per-expert tensors into the model's 3-D experts: the source owns the checkpoint now
            self._serialized = self._keys(model, quantized)
        except BaseException:
            ckpt.close()
            raise
        self._ckpt = ckpt

    def _hub_manifest(self, root: Path, repo_dir: Path, repo_id: str, commit: str, subfolder: str) -> None:
        """Resolve the manifest of a hub repository into the snapshot transformers downloaded the
        shards to (transformers downloads only the files the weight index names): transformers'
        own ``cached_file``, at the commit and cache the shards came from."""
        from transformers.utils import cached_file
        try:  # a file already in the snapshot is returned without asking the hub
            cached_file(repo_id, MANIFEST_NAME, cache_dir=str(repo_dir.parent), revision=commit, subfolder=subfolder)
        except OSError as e:
            raise CheckpointError(f"config.json says quant_method {QUANT_METHOD!r}, but hub repository {repo_id} at "
                                  f"revision {commit} gives no {MANIFEST_NAME} (te-serial's manifest, which "
                                  f"save_quantized writes beside the shards: upload the whole directory): {e}",
                                  file=str(root / MANIFEST_NAME)) from e

    def _keys(self, model: nn.Module, quantized: dict[str, TensorProto]) -> dict[str, list[str]]:
        """``serialized_names`` from the manifest's prototypes: per parameter name (``weight``), the
        keys of its quantized tensors' small buffers; the data buffers' keys become ignored on the model."""
        triggers: dict[str, set[str]] = {}
        data: set[str] = set()
        for name, proto in quantized.items():
            q = proto.quantizer
            leaf = name.rpartition(".")[2]
            data_buffers = q.data_buffers()
            buffers = list(expected_buffers(proto))
            small = [b for b in buffers if b not in data_buffers]
            if not small:
                raise UnsupportedOperationError(f"{name}: a {q.kind} tensor with no scale buffer")
            triggers.setdefault(leaf, set()).update(f"{leaf}.{b}" for b in small)
            data.update(f"{leaf}.{b}" for b in buffers if b in data_buffers)
        if data:  # read by te-serial, never by transformers: not "unexpected"
            ignore = r"\.(?:" + "|".join(re.escape(k) for k in sorted(data)) + r")$"
            model._keys_to_ignore_on_load_unexpected = {*(model._keys_to_ignore_on_load_unexpected or ()), ignore}
        return {leaf: sorted(names) for leaf, names in triggers.items()}

    def _check_modules(self, quantized: dict, root: Path) -> None:
        """config.json's ``modules`` against the manifest's prototypes (when config.json lists them)."""
        said = self.quantization_config.modules
        if said is None:
            return
        found = quantization_config(quantized) or {"modules": {}}
        wrong = sorted(set(said) ^ set(found["modules"]))
        wrong += sorted(m for m in set(said) & set(found["modules"]) if said[m] != found["modules"][m])
        if wrong:
            raise CheckpointError(f"config.json's quantization_config disagrees with {MANIFEST_NAME} for modules "
                                  f"{wrong[:10]} (a config.json from another checkpoint?)", file=str(root),
                                  field="quantization_config.modules")

    def _recipe_choice(self, model: nn.Module) -> dict[str, Any]:
        """quantize_model's choice of weights for the config's recipe (``choose_weights``: linears and
        3-D expert stacks), less ``exclude``."""
        cfg = self.quantization_config
        col = "columnwise" in cfg.usages if cfg.usages is not None else torch.is_grad_enabled()
        row = "rowwise" in cfg.usages if cfg.usages is not None else True
        self._q = q = recipe_quantizer(cfg.recipe, rowwise=row, columnwise=col)
        return {n: c for n, c in choose_weights(model, q).items() if not _matches(c.module_name, cfg.exclude)}

    def _plan(self, model: nn.Module, checkpoint_files: list[str] | None) -> None:
        """Quantize on load: the weights to quantize as transformers hands them over; or, for a
        checkpoint in a quantized layout te-serial reads, :meth:`_read_itself`."""
        from .conversion.sources import open_source
        cfg = self.quantization_config
        files = [str(f) for f in checkpoint_files or []]
        if files and all(f.endswith(".safetensors") for f in files):
            root = Path(files[0]).parent
            source = open_source(root)
            try:
                if self._read_itself(model, source, root):
                    return
            except BaseException:
                source.close()
                raise
            source.close()
        elif cfg.source_method is not None:
            raise CheckpointError(f"config.json says quant_method {cfg.source_method!r}: te-serial reads such a "
                                  f"checkpoint from its safetensors files, transformers found {files[:3]!r}")
        if cfg.recipe is None:
            raise FormatError("quantize on load needs a recipe: TeSerialConfig(recipe=...), one of "
                              + ", ".join(RECIPES))
        chosen = self._recipe_choice(model)
        q = self._q
        self._to_quantize = {n: (c.module_name, c.quantizer) for n, c in chosen.items()}
        if q.takes_tensor_amax():
            groups = fusion.groups_for(fusion.architecture_of(model_config_dict(model)), cfg.fused)
            for members in fusion.fused_groups(chosen_linears(chosen), groups, suffix=""):
                self._group_of.update({m: members for m in members})
        self._files = files

    def _read_itself(self, model: nn.Module, source: Any, root: Path, *, as_saved: bool = False) -> bool:
        """Whether te-serial reads ``source`` itself, as ``load_into`` does, instead of transformers
        reading its keys: a layout transformers would misread (DeepSeek FP8, ModelOpt,
        compressed-tensors…), or quantized per-expert tensors the model holds as 3-D experts. If so,
        plans each tensor te-serial gives: those the source holds quantized, and the recipe's choice
        (none with ``as_saved``: a te-serial checkpoint's tensors load as they were saved)."""
        slots = tensor_slots(model)
        view = as_model_names(source, slots)
        if (view is source and source.layout == "te-serial") or \
                not any(st.quantizer is not None for n, st in view.tensors.items() if n in slots):
            return False  # transformers reads the keys (te-serial's own names, or plain weights to quantize)
        cfg = self.quantization_config
        chosen = self._recipe_choice(model) if cfg.recipe is not None and not as_saved else {}
        targets = {}
        for name, st in view.tensors.items():
            if name not in slots:
                continue
            module, attr, is_param, old = slots[name]
            if name in chosen:
                proto = TensorProto(tuple(old.shape), old.dtype, chosen[name].quantizer)
                targets[name] = (module, attr, is_param, proto.create_tensor(device="meta"))
            elif st.quantizer is not None:
                targets[name] = slots[name]
        steps, _, _ = plan_load(view, targets, root, derive_usages=True, strict=False, fused=cfg.fused,
                                config=model_config_dict(model), reads=True)
        self._source, self._steps, self._chosen = view, steps, set(chosen) & set(targets)
        self._file_keys = {n: view.file_keys(n) for n in targets}
        self._dropped_keys = list(view.dropped)
        # transformers quantizes none of these; not "pre-quantized", it defers each read to the
        # converter (no read-ahead threads), so SourceKeys can leave the data unread
        self.pre_quantized = False
        model._keys_to_ignore_on_load_unexpected = {*(model._keys_to_ignore_on_load_unexpected or ()),
                                                    "^" + re.escape(HELD_KEY) + "$"}
        return True

    def param_needs_quantization(self, model: nn.Module, param_name: str, **kwargs: Any) -> bool:
        return param_name in self._to_quantize

    @property
    def serialized_names(self) -> dict[str, list[str]]:
        return self._serialized if self.pre_quantized else {}

    def get_load_operations(self) -> dict:
        return {"deserialize": TeSerialDeserialize}

    def get_quantize_ops(self) -> ConversionOps:
        return TeSerialQuantize(self)

    def update_weight_conversions(self, weight_conversions: list, model: nn.Module) -> list:
        if self._source is not None:  # te-serial reads these keys itself: routed before any model converter
            renamings = [c for c in weight_conversions if isinstance(c, WeightRenaming)]
            route = {apply_renamings(k, renamings): (HELD_KEY, HELD) for k in self._dropped_keys}
            for name, keys in self._file_keys.items():
                renamed = [apply_renamings(k, renamings) for k in keys]
                route.update(dict.fromkeys(renamed, (HELD_KEY, HELD)))
                if not renamed:
                    continue
                others = [k for k in renamed if k != name]
                route[others[-1] if others else name] = (name, TRIGGER)  # the last key: a scale, where there is one
                if others and name in renamed:
                    route[name] = (name, NAMED)
            return [SourceKeys(self, route), *super().update_weight_conversions(weight_conversions, model)]
        if self.pre_quantized and self._ckpt is not None:
            quantized = [n for n, p in self._ckpt.protos.items() if p.quantizer is not None]
            for conv in weight_conversions:
                if isinstance(conv, WeightConverter):
                    hit = next((n for n in quantized if conv.compiled_sources.search(n)), None)
                    if hit is not None:
                        raise UnsupportedOperationError(
                            f"{type(model).__name__}'s conversion mapping rewrites {hit!r} "
                            f"({conv.source_patterns} → {conv.target_patterns}): te-serial neither merges nor "
                            "renames quantized tensors, so they load through from_pretrained only under the "
                            "model's own parameter names (te_serial.load_into loads this checkpoint into a model "
                            "that has its names; or quantize the model's BF16 checkpoint on load)")
        return super().update_weight_conversions(weight_conversions, model)

    # --- one weight at a time -----------------------------------------------------------------------
    def _source_name(self, name: str, model: nn.Module) -> str:
        protos = self._ckpt.protos
        if name in protos:
            return name
        prefix = getattr(model, "base_model_prefix", "") or ""
        for alt in (name.removeprefix(f"{prefix}.") if prefix else None, f"{prefix}.{name}" if prefix else None):
            if alt and alt in protos:
                return alt
        raise CheckpointError("no quantized tensor of this name in the checkpoint", file=str(self._ckpt.path),
                              tensor=name)

    def _read_source(self, name: str, device: torch.device, model: nn.Module) -> nn.Parameter:
        """A tensor :meth:`_read_itself` planned, as ``load_into`` gives it: the model's dtype as its
        nominal dtype; ``requires_grad`` the model's for what the recipe quantized, else the saved one."""
        t, _ = read_for_model(self._source, name, self._steps.get(name), device, self._source.path)
        param = model.get_parameter(name)
        t = with_nominal(t, param.dtype)
        quantized = isinstance(t, QuantizedTensorStorage)
        grad = param.requires_grad if name in self._chosen or not quantized else \
            self._source.tensors[name].proto.requires_grad
        return nn.Parameter(t.detach(), requires_grad=grad and (quantized or t.is_floating_point()))

    def _read_quantized(self, name: str, device: torch.device, model: nn.Module) -> nn.Parameter:
        src = self._source_name(name, model)
        t = self._ckpt.get(src, device=device)
        t = with_nominal(t, model.get_parameter(name).dtype)  # as load_into: the model's dtype
        return nn.Parameter(t.detach(), requires_grad=self._ckpt.protos[src].requires_grad)

    def _quantize(self, name: str, value: torch.Tensor, model: nn.Module) -> nn.Parameter:
        mname, q = self._to_quantize[name]
        amax = self._group_amax(mname, value, model)
        qt = q.quantize(value.detach(), tensor_amax=amax)
        return nn.Parameter(qt, requires_grad=model.get_parameter(name).requires_grad)

    def _group_amax(self, mname: str, value: torch.Tensor, model: nn.Module) -> Any:
        """The fused group's shared amax, as quantize_model computes it (None: no group)."""
        members = self._group_of.get(mname)
        if members is None:
            return None
        if mname not in self._amax:
            weights = {m: value if m == mname else self._read_plain(f"{m}.weight", value.dtype, model, members)
                       for m in members}
            shared = shared_amax(model, self._q, weights, self.quantization_config.fused)
            self._amax.update({m: shared.get(m) for m in members})
            del weights
        return self._amax.pop(mname)

    def _read_plain(self, name: str, dtype: torch.dtype, model: nn.Module, members: tuple[str, ...]) -> torch.Tensor:
        """A fused-group partner from the checkpoint files, cast to ``dtype`` as transformers casts it."""
        from safetensors import safe_open
        if self._key_files is None:  # every file's keys, once (headers only)
            self._key_files = {}
            for file in self._files:
                if file.endswith(".safetensors"):
                    with safe_open(file, framework="pt", device="cpu") as f:
                        self._key_files.update(dict.fromkeys(f.keys(), file))
        prefix = getattr(model, "base_model_prefix", "") or ""
        keys = [name] + ([name.removeprefix(f"{prefix}."), f"{prefix}.{name}"] if prefix else [])
        found = next((k for k in keys if k in self._key_files), None)
        if found is not None:
            with safe_open(self._key_files[found], framework="pt", device="cpu") as f:
                return f.get_tensor(found).to(dtype)
        raise ConversionError(f"fused group {list(members)}: {name} is not in the checkpoint under its own name, so "
                              "the group's shared amax cannot be read; TeSerialConfig(fused='off') quantizes each "
                              "member on its own", tensor=name)

    # --- after loading ----------------------------------------------------------------------------
    def _process_model_after_weight_loading(self, model: nn.Module, **kwargs: Any) -> nn.Module:
        for opened in (self._ckpt, self._source):
            if opened is not None:
                opened.close()  # loaded tensors keep their own mappings
        self._ckpt = self._source = None
        self._amax.clear()
        self._key_files = None
        protos = {n: to_tensor_proto(p) for n, p in model.named_parameters()
                  if isinstance(p, QuantizedTensorStorage)}
        if protos:
            guard_save_pretrained(model)  # save_pretrained writes a te-serial directory
        if not self.pre_quantized:  # quantized on load, or read by te-serial: the config says what the model holds
            held = quantization_config(protos) or {}
            self.quantization_config.modules = held.get("modules", {})
            self.quantization_config.usages = held.get("usages", self.quantization_config.usages)
        return model

    def _dequantize(self, model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
        for module in model.modules():
            for pname, p in list(module._parameters.items()):
                if isinstance(p, QuantizedTensorStorage):
                    plain = p.dequantize(dtype=dtype) if dtype is not None else p.dequantize()
                    module._parameters[pname] = nn.Parameter(plain.detach(), requires_grad=p.requires_grad)
        model.__dict__.pop("save_pretrained", None)
        return model

    def is_serializable(self, *args: Any, **kwargs: Any) -> bool:
        return False  # te_serial.save_quantized writes these models

    @property
    def is_trainable(self) -> bool:
        return True  # adapters (PEFT) over the quantized base; the quantized weights themselves stay frozen

    @property
    def is_compileable(self) -> bool:
        return False


def _merge_quantization_configs(cls: type, quantization_config: Any, quantization_config_from_args: Any) -> Any:
    """transformers' ``AutoHfQuantizer.merge_quantization_configs``, except that a
    :class:`TeSerialConfig` given to ``from_pretrained`` for a checkpoint of another layout
    (DeepSeek FP8, compressed-tensors, …) is taken, recording that layout's quant_method: te-serial
    reads the checkpoint (transformers would refuse the two configs)."""
    if isinstance(quantization_config_from_args, TeSerialConfig):
        method = quantization_config.get("quant_method") if isinstance(quantization_config, dict) \
            else getattr(quantization_config, "quant_method", None)
        if str(method) != QUANT_METHOD:
            quantization_config_from_args.source_method = str(method)
            return quantization_config_from_args
    return _TRANSFORMERS_MERGE(quantization_config, quantization_config_from_args)


def _register() -> None:
    """Register the ``te_serial`` method (importing this module does it, once per process)."""
    global _TRANSFORMERS_MERGE
    from transformers.quantizers.auto import AutoHfQuantizer
    merge = AutoHfQuantizer.__dict__["merge_quantization_configs"]
    if getattr(merge, "__func__", None) is not _merge_quantization_configs:
        _TRANSFORMERS_MERGE = AutoHfQuantizer.merge_quantization_configs
        AutoHfQuantizer.merge_quantization_configs = classmethod(_merge_quantization_configs)
    if AUTO_QUANTIZATION_CONFIG_MAPPING.get(QUANT_METHOD) is not TeSerialConfig:
        AUTO_QUANTIZATION_CONFIG_MAPPING.pop(QUANT_METHOD, None)  # a reloaded module replaces its classes
        register_quantization_config(QUANT_METHOD)(TeSerialConfig)
    if AUTO_QUANTIZER_MAPPING.get(QUANT_METHOD) is not TeSerialHfQuantizer:
        AUTO_QUANTIZER_MAPPING.pop(QUANT_METHOD, None)
        register_quantizer(QUANT_METHOD)(TeSerialHfQuantizer)


_register()
