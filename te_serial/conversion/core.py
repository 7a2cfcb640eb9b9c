"""``convert``: any checkpoint te-serial reads → any recipe or layout it writes, one tensor at a time.

The conversion is planned before any byte is read: each tensor's path (keep, exact relayout,
requantize, dequantize…) and every output buffer's key, shape and dtype follow from the source's
data-free prototypes and the rules. The output files are laid out from that plan, so each tensor
is read, converted, checked against its source, written at its offset and freed before the next
one: memory is set by the largest tensor, not by the checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from ..checkpoint.manifest import MANIFEST_NAME, SELF_FILE, buffer_key, expected_buffers
from ..checkpoint.fileops import atomic_write, fsync_path, writing
from ..checkpoint.header import SHARD_METADATA, old_objects_frozen
from ..checkpoint.shards import ShardSet
from ..checkpoint.writer import CheckpointWriter, hf_config_for, parse_size, without_te_serial_config, write_hf_files
from ..dtypes import dtype_from_name
from ..errors import CheckpointError, ConversionError, FormatError, ShapeError, TeSerialError
from ..formats.slicing import slice_quantized
from ..formats.tensors import QuantizedTensorStorage
from ..fusion import architecture_of, checks_scale, fused_groups, groups_for
from ..proto import TensorProto
from .fused_scales import share_fused_amax
from .layouts import FAMILIES as LAYOUTS
from .layouts.base import codes_check, module_of, prefix
from .layouts.common import KV_CACHE_SCALES, SIDECAR_NAME, parse_mode, sidecar_entry, write_sidecar
from .report import DROPPED, EXACT_CODES, LOSSLESS, LOSSY, ConversionReport, TensorReport
from .pipeline import run_pipeline
from ..moe import is_per_expert
from ..precision import is_expert_weight
from .sources import (ACT_AMAX_KEY, CONFIG_NAME, INDEX_NAME, GroupedView, Source, SourceTensor, open_source,
                      split_experts)
from .targets import (FAMILY_LAYOUT, KEEP, Rules, describe_dtype, describe_quantizer, load_rules, target,
                      usage_label)
from .transforms import (GROUPED_MODES, ROW, STATS_MODES, ErrorStats, Step, compare, compare_rows, enabled, execute,
                         all_rows, plan_external, plan_keep_external, plan_plain, plan_te, rows_of, sample_rows, to_device,
                         values)

CPU = torch.device("cpu")

ProgressFn = Callable[[int, int, str], Any]


@dataclasses.dataclass(frozen=True)
class ExportSpec:
    """What a serving-layout export writes for every quantized weight: the layout, each weight's
    scheme, the activation scheme chosen per weight scheme, and each layer's activation amax
    (static scales). Several weight schemes make a mixed export (``ExternalLayout.mixed_config``)."""

    family: str
    schemes: Mapping[str, str]          # quantized weight name → its weight scheme
    modes: Mapping[str, str]            # every weight scheme the rules name → its activation scheme
    activation_amax: Mapping[str, float]
    note: str = ""
    dropped: tuple[str, ...] = ()       # TE module-state tensors left out of the export
    fused: tuple[tuple[str, ...], ...] = ()   # weights an engine fuses (te_serial.fusion)
    fused_rule: Any = "auto"            # convert's fused= (te_serial.fusion.FUSED_MODES, or groups)
    kv_cache: bool = False              # FP8 KV-cache scales written (KV_CACHE_SCALES): the config states them

    @property
    def layout(self):
        return LAYOUTS[self.family]

    def scheme_of(self, name: str) -> str:
        return self.schemes[name]

    def mode_of(self, name: str) -> str:
        return self.modes[self.schemes[name]]

    @property
    def mixed(self) -> bool:
        return len(self.modes) > 1

    @property
    def fused_enforced(self) -> bool:
        """Is a fused group written with unequal scales that must be equal refused (else, with
        ``fused="off"``, reported)?"""
        return self.fused_rule not in (None, "off")

    def shared_scale_keys(self, name: str, q) -> tuple[str, ...]:
        """The key suffixes of weight ``name`` (written by quantizer ``q``) that must be equal across its
        fused group: the static input scales, and the weight's tensor scale where the export makes it
        one per group or engines need it so (:func:`te_serial.fusion.checks_scale`)."""
        return self.layout.shared_scale_keys(self.scheme_of(name), weight=checks_scale(q, self.fused_rule))

    @property
    def name(self) -> str:
        return self.layout.mixed_name if self.mixed else self.layout.layout_name(next(iter(self.modes)))

    def groups(self) -> list[tuple[str, str, list[str]]]:
        """(weight scheme, activation mode, modules) for every scheme, modules in checkpoint order."""
        return [(s, m, [module_of(n) for n, ws in self.schemes.items() if ws == s]) for s, m in self.modes.items()]


@dataclasses.dataclass
class TensorPlan:
    """One tensor's planned conversion: its step and the output buffers it will write."""

    name: str
    src: SourceTensor
    step: Step | None                    # None for a tied tensor (it shares another's buffers)
    target: str                          # the output format, as the report names it
    keys: list[tuple[str, tuple[int, ...], torch.dtype]]
    alias_of: str | None = None
    shard: int = 0
    export: ExportSpec | None = None     # serving layouts: how a quantized weight is written
    members: tuple[int, int] | None = None   # a range of a grouped tensor's experts, converted on their own

    @property
    def nbytes(self) -> int:
        return sum(math.prod(s) * d.itemsize for _, s, d in self.keys)


# --- planning ------------------------------------------------------------------------------------

def _parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    t = target(dtype) if dtype in ("bf16", "fp16", "fp32", "bfloat16", "float16", "float32") else None
    if t is not None:
        return t.dtype
    try:
        return dtype_from_name(dtype)
    except FormatError as e:
        raise ConversionError(str(e), field="dtype") from None


def _parse_usages(usages: str | Sequence[bool] | None) -> tuple[bool, bool] | None:
    if usages is None:
        return None
    if isinstance(usages, str):
        table = {"rowwise": (True, False), "row": (True, False), "columnwise": (False, True),
                 "col": (False, True), "both": (True, True), "row+col": (True, True)}
        if usages not in table:
            raise ConversionError(f"usages must be one of {sorted(table)}, got {usages!r}", field="usages")
        return table[usages]
    r, c = (bool(v) for v in usages)
    if not (r or c):
        raise ConversionError("usages needs rowwise or columnwise", field="usages")
    return r, c


def _fmt(q, dtype: torch.dtype, family: str, spec: "ExportSpec | None" = None, name: str = "") -> str:
    if q is None:
        return describe_dtype(dtype)
    scheme = spec.schemes.get(name) if spec is not None else None
    if scheme is not None:
        return spec.layout.tensor_format(scheme)
    return f"{describe_quantizer(q)}/{usage_label(q)}"


def _src_fmt(st: SourceTensor) -> str:
    if st.quantizer is None or st.fmt in ("deepseek_fp8", "ct_fp8_tensor", "ct_fp8_channel", "ct_fp8_block"):
        return st.fmt
    return f"{st.fmt}/{st.usages}"


def _keep(st: SourceTensor, note: str = "") -> Step:
    return Step("keep", st.quantizer, st.dtype, exact=True, builder="keep", note=note)


def _plan_step(st: SourceTensor, value: str, explicit: bool, family: str, dtype: torch.dtype,
               usages: tuple[bool, bool] | None, schemes: Sequence[str], src_file: str) -> tuple[Step, str | None]:
    """The tensor's step, and for a weight written quantized into a serving layout its scheme
    (``schemes``: the weight schemes the export holds)."""
    name, shape = st.name, st.shape

    def keep_external(p) -> tuple[Step, str | None]:
        # kept in the layout where one of its schemes holds the source's bytes exactly, else plain; an
        # experts-only layout (gpt-oss) holds nothing quantized but the 3-D experts it plans itself
        step = None
        experts_only = family in LAYOUTS and LAYOUTS[family].experts_only
        for scheme in (() if experts_only else schemes) or (None,):
            rep = LAYOUTS[family].representation(scheme) if scheme else None
            if rep is not None and p is not None:
                rep = p.serving_form(rep)
            step = plan_keep_external(family, p, st.dtype, dtype, scheme, st.uniform_rows, shape, rep, name)
            if step.out_q is not None:
                return step, scheme
        return step, None

    if value == KEEP:
        if family == "te":
            return _keep(st), None
        return keep_external(st.quantizer)
    t = target(value)
    if st.quantizer is None and not st.dtype.is_floating_point:
        if family == "te":
            return _keep(st, "not floating point: kept as it is"), None
        step, scheme = keep_external(None)
        return dataclasses.replace(step, note="not floating point: kept as it is"), scheme

    def refuse(why: str) -> tuple[Step, str | None]:
        if explicit:
            raise ConversionError(f"rule target {value!r}: {why}; add a 'keep' rule for it before this one",
                                  file=src_file, tensor=name)
        if family == "te":
            return _keep(st, f"kept: {why}"), None
        step, scheme = keep_external(st.quantizer)
        return dataclasses.replace(step, note=f"kept: {why}"), scheme

    if t.family == "plain":
        return plan_plain(st.quantizer, st.dtype, t.dtype), None
    if t.family == "te":
        use = usages or (st.quantizer.default_usages() if st.quantizer is not None else (True, True))
        try:
            q = t.quantizer(rowwise=use[0], columnwise=use[1])
            if st.quantizer is not None:
                q = st.quantizer.for_target(q)   # a grouped weight: each member in the recipe
            q.check_shape(shape)
        except (ShapeError, FormatError) as e:
            return refuse(str(e))
        return plan_te(st.quantizer, q, dtype, st.dtype), None
    layout = LAYOUTS[family]
    if is_expert_weight(name, shape):  # 3-D experts the architecture's checkpoints keep whole (gpt-oss)
        rep = layout.expert_representation(t.scheme, shape)
        if rep is None:
            raise ConversionError(f"{t.name}: MoE experts held as one 3-D tensor (shape {list(shape)}; this "
                                  "architecture's checkpoints do not name each expert) are not written to this "
                                  "serving layout; convert to gpt_oss_mxfp4 (gpt-oss), a te-serial recipe or bf16",
                                  file=src_file, tensor=name)
        return plan_external(st.quantizer, t.scheme, rep, dtype, st.dtype, st.uniform_rows), t.scheme
    if layout.experts_only:
        return refuse(f"{t.name} quantizes MoE experts only (3-D <p>.experts.<proj>); the rest stays high precision")
    if len(shape) != 2 or not (name == "weight" or name.endswith(".weight")):
        return refuse(f"{t.name} holds 2-D '*.weight' tensors only (got shape {list(shape)})")
    rep = layout.representation(t.scheme)
    if st.quantizer is not None:
        rep = st.quantizer.serving_form(rep)  # e.g. 4over6's E4M3 bound, which the layouts state as it is
    try:
        rep.check_shape(shape)
    except ShapeError as e:
        return refuse(f"{t.name}: {e}")
    return plan_external(st.quantizer, t.scheme, rep, dtype, st.dtype, st.uniform_rows), t.scheme


def _layout(family: str, name: str, shape: tuple[int, ...], step: Step,
            spec: ExportSpec | None) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    q = step.out_q
    if q is None:
        return [(name, shape, step.out_dtype)]
    if family == "te":
        return [(buffer_key(name, b), s, d) for b, (s, d) in expected_buffers(step.proto(shape)).items()]
    keys = spec.layout.weight_keys(name, tuple(shape), spec.scheme_of(name))
    if spec.mode_of(name) == "static":
        keys += spec.layout.act_keys(name, spec.scheme_of(name))
    return keys


def export_buffers(family: str, name: str, out: torch.Tensor,
                   spec: ExportSpec | None = None) -> dict[str, torch.Tensor]:
    """The safetensors keys and tensors ``out`` (tensor ``name``, converted) is written as: te-serial's
    buffers under their stored dtypes, or the serving layout's keys (``spec``)."""
    if not isinstance(out, QuantizedTensorStorage):
        return {name: out}
    if family == "te":
        vals = out.quantizer.value_dtypes()
        return {buffer_key(name, n): t.view(vals[n]) for n, t in out.buffers().items()}
    scheme = spec.scheme_of(name)
    blobs = spec.layout.export(name, out, scheme)
    if spec.mode_of(name) == "static":
        blobs.update(spec.layout.export_act(name, scheme, spec.activation_amax[module_of(name)]))
    return blobs


def _file_of(source: Source, st: SourceTensor) -> str:
    entry = st.keys.get("entry")
    if entry is not None:
        b = next(iter(entry.buffers.values()), None)
        root = source.path if source.path.is_dir() else source.path.parent
        return str(source.path if b is None or b.file == SELF_FILE else root / b.file)
    key = st.keys.get("data") or st.keys.get("weight")
    file_of = getattr(source, "file_of", None)
    try:
        return file_of(key) if file_of is not None and key is not None else str(source.path)
    except KeyError:
        return str(source.path)


def _parse_amax(activation_amax) -> dict[str, float]:
    """``activation_amax=``: {module (or its ``.weight``): amax} or a JSON file of that (as
    :class:`~te_serial.conversion.ActivationAmax` saves from a calibration pass)."""
    if activation_amax is None:
        return {}
    if isinstance(activation_amax, (str, os.PathLike)):
        try:
            activation_amax = json.loads(Path(activation_amax).read_text(encoding="utf-8"))
        except (OSError, ValueError, UnicodeDecodeError) as e:
            raise ConversionError(f"cannot read activation amax: {e}", file=str(activation_amax)) from None
    if not isinstance(activation_amax, Mapping):
        raise ConversionError("activation_amax must map module names to amax values", field="activation_amax")
    out = {}
    for k, v in activation_amax.items():
        try:
            a = float(v)
        except (TypeError, ValueError):
            raise ConversionError(f"activation amax of {k!r} is not a number: {v!r}", field="activation_amax") from None
        if not (math.isfinite(a) and a > 0):
            raise ConversionError(f"activation amax of {k!r} must be finite and > 0, got {a}", field="activation_amax")
        out[module_of(str(k))] = a
    return out


def plan_conversion(source: Source, *, recipe: str | None = None, rules=None, dtype: torch.dtype | str = torch.bfloat16,
                    usages=None, activations: str | None = "auto", activation_amax=None,
                    fused: str | Sequence[Sequence[str]] | None = "auto"
                    ) -> tuple[str, ExportSpec | None, list[TensorPlan]]:
    """(output family, the serving export's :class:`ExportSpec` (None for te-serial and plain
    outputs), per-tensor plans) — no data is read. ``activations`` / ``activation_amax`` /
    ``fused``: see :func:`convert`."""
    if isinstance(rules, (str, os.PathLike)):
        rules = load_rules(rules)
    r = Rules(rules, recipe)
    family = r.family()
    schemes: list[str] = []
    if family in LAYOUTS:  # in the order the rules name them (the recipe last)
        schemes = list(dict.fromkeys(target(v).scheme for v in r.values() if target(v).family == family))
    dtype = _parse_dtype(dtype)
    use = _parse_usages(usages)
    mode = parse_mode(activations)
    # a plain checkpoint in one dtype: what is kept but quantized is dequantized to the recipe's dtype
    keep_dtype = target(recipe).dtype if recipe is not None and target(recipe).family == "plain" else dtype
    module_state = getattr(source, "extra_state_tensors", set()) if family in LAYOUTS else set()
    steps: list[tuple[str, SourceTensor, Step]] = []
    scheme_of: dict[str, str] = {}
    # a step depends on the tensor's name only through these two (a MoE's thousands of experts share few)
    planned: dict[tuple, tuple[Step, str | None]] = {}
    for name, st in source.tensors.items():
        if name in module_state:
            continue  # TE module state (amax history…): not a weight; its activation amax is used below
        value, explicit = r.lookup(name, st.shape)
        key = (st.proto, st.fmt, st.uniform_rows, value, explicit, is_expert_weight(name, st.shape),
               name == "weight" or name.endswith(".weight"))
        if key not in planned:
            planned[key] = _plan_step(st, value, explicit, family, keep_dtype if value == KEEP else dtype, use,
                                      schemes, _file_of(source, st))
        step, scheme = planned[key]
        steps.append((name, st, step))
        if scheme is not None and step.out_q is not None:
            scheme_of[name] = scheme
    spec = None
    if family in LAYOUTS:
        acts = dict(source.activation_amax)
        acts.update(_parse_amax(activation_amax))
        modes, notes = {}, _fill_expert_amax(acts, [module_of(n) for n in scheme_of])
        for s in schemes:  # each weight scheme's activation scheme, from the amax of its own layers
            quantized = [module_of(n) for n, ws in scheme_of.items() if ws == s]
            with_amax = sum(m in acts for m in quantized)
            modes[s], note = LAYOUTS[family].resolve_mode(s, mode, with_amax, len(quantized))
            experts = [n for n, ws in scheme_of.items() if ws == s and is_per_expert(n)]
            LAYOUTS[family].check_experts(s, modes[s], experts)
            notes.append(note if len(schemes) == 1 else f"{LAYOUTS[family].layout_name(s)} layers: {note}")
        # fused weights share their input: one static input scale, the largest (as engines take it)
        groups = fused_groups(scheme_of, groups_for(architecture_of(source.config),
                                                    "auto" if fused in (None, "off") else fused))
        for members in groups:
            given = [acts[module_of(m)] for m in members if module_of(m) in acts]
            if len(given) == len(members):
                acts.update({module_of(m): max(given) for m in members})
        spec = ExportSpec(family, scheme_of, modes,
                          {module_of(n): acts[module_of(n)] for n in scheme_of if module_of(n) in acts},
                          "; ".join(notes), tuple(sorted(module_state)), tuple(groups), fused,
                          any(n.endswith(KV_CACHE_SCALES) and st.quantizer is None for n, st in source.tensors.items()))
    plans: list[TensorPlan] = []
    by_name: dict[str, TensorPlan] = {}
    for name, st, step in steps:
        plan = TensorPlan(name, st, step, _fmt(step.out_q, step.out_dtype, family, spec, name),
                          _layout(family, name, st.shape, step, spec), export=spec)
        plans.append(plan)
        by_name[name] = plan
    if family == "te":  # tied tensors stay tied when both sides take the same path
        for plan in plans:
            a = plan.src.alias_of
            if a is not None and a in by_name:
                other = by_name[a]
                if other.step is not None and other.step.proto(other.src.shape) == plan.step.proto(plan.src.shape) \
                        and other.step.method == plan.step.method:
                    plan.alias_of, plan.step, plan.keys = a, None, []
    return family, spec, plans


# --- output ---------------------------------------------------------------------------------------

#: files a conversion writes (besides shards and config.json): an overwrite removes the old ones,
#: so a stale hf_quant_config.json cannot make a compressed-tensors export read as ModelOpt
_OWN_FILES = (MANIFEST_NAME, INDEX_NAME, SIDECAR_NAME, *(n for lay in LAYOUTS.values() for n in lay.extra_file_names))


def _hf_shard_name(i: int, n: int) -> str:
    """Hugging Face's shard names."""
    return "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


class _Output:
    """The files of one conversion, through the one writer: a te-serial checkpoint through
    :class:`CheckpointWriter`, other layouts through the same planned shard files, committed by
    their index (and ``config.json``) last."""

    def __init__(self, dst: Path, family: str, plans: list[TensorPlan], limit: int, source: Source,
                 metadata: dict[str, str]) -> None:
        self.dst, self.family, self.plans = dst, family, plans
        self.planned = {p.name for p in plans}
        self.single = dst.suffix == ".safetensors"
        self.root = dst.parent if self.single else dst
        self.old = self._existing()
        with writing(self.root):
            self.root.mkdir(parents=True, exist_ok=True)
        self.writer: CheckpointWriter | None = None
        self.files: ShardSet | None = None
        self.sidecar: dict[str, dict] = {}
        self.shared: dict[str, dict[str, torch.Tensor]] = {}  # fused-group members: their one-per-group scales
        if family == "te":
            protos = {p.name: p.step.proto(p.src.shape) for p in plans if p.alias_of is None}
            protos = {p.name: protos[p.alias_of or p.name] for p in plans}
            aliases = {p.name: p.alias_of for p in plans if p.alias_of is not None}
            tree = source.tree if source.layout == "te-serial" else None
            self.writer = CheckpointWriter(dst, protos, aliases=aliases, tree=tree, max_shard_size=limit,
                                           metadata=metadata)
        else:
            self.files = ShardSet(self.root, _file_order(source, plans), limit=limit,
                                  single=dst if self.single else None, metadata=SHARD_METADATA,
                                  shard_name=_hf_shard_name)

    def prepare(self, plan: TensorPlan, out: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        """What :meth:`write` writes of ``out`` (on the CPU): the tensor itself for a te-serial checkpoint,
        else the layout's safetensors buffers (the sidecar entry and shared scales recorded). Done on the
        compute thread, so the writer's only work is the writing."""
        if self.writer is not None:
            return out
        blobs = export_buffers(self.family, plan.name, out, plan.export)
        if set(blobs) != {k for k, _, _ in plan.keys}:
            raise ConversionError(f"output buffers {sorted(blobs)} differ from the plan "
                                  f"{sorted(k for k, _, _ in plan.keys)}", tensor=plan.name)
        # an exact path keeps the source's rowwise bytes: record the source's own quantizer
        self.record(plan, sidecar_entry(out, plan.src.quantizer if plan.step.exact else None)
                    if plan.export is not None and isinstance(out, QuantizedTensorStorage) else None, blobs)
        return blobs

    def record(self, plan: TensorPlan, entry: dict | None, blobs: Mapping[str, torch.Tensor]) -> None:
        """Keep what the commit needs of one exported weight: its sidecar ``entry``, and the scales a
        fused group's members must share (checked once all are written)."""
        if entry is not None:
            self.sidecar[plan.name] = entry
        if plan.export is not None and plan.name in plan.export.schemes:
            keys = plan.export.shared_scale_keys(plan.name, plan.step.out_q)
            self.shared[plan.name] = {k: blobs[prefix(plan.name) + k].clone() for k in keys if prefix(plan.name) + k in blobs}

    def write(self, plan: TensorPlan, prepared: "torch.Tensor | dict[str, torch.Tensor] | _Runs") -> None:
        """Write what :meth:`prepare` (or :func:`_export_joined`) made of one tensor."""
        if self.writer is not None and plan.members is not None:
            self.writer.write_members(plan.name, prepared)
        elif self.writer is not None:
            self.writer.write(plan.name, prepared)
        elif isinstance(prepared, _Runs):
            for keys, t in prepared.runs:
                if not self.files.write_run(keys, t):
                    for key in keys:
                        self.files.write(key, prepared.parts[key])
        else:
            for key, t in prepared.items():
                self.files.write(key, t)

    def commit(self, config: dict | None, aux: list[Path], extra: Mapping[str, Any] | None = None) -> list[str]:
        """Commit the weights (manifest or index last), then the model directory's other files
        (``extra``: name → JSON document or bytes, e.g. ``hf_quant_config.json``, the sidecar)."""
        if self.writer is not None:
            manifest = self.writer.close()
            written = [self.dst.name] if self.single else [*manifest.files, MANIFEST_NAME]
        else:
            sizes = self.files.finish()
            self.files.commit()
            written = list(sizes)
            if not self.single:  # an index even for one shard: engines' sharded readers look for it
                index = {"metadata": {"total_size": sum(p.nbytes for p in self.plans)},
                         "weight_map": {k: self.files.names[self.files.file_of[k]]
                                        for p in self.plans for k, _, _ in p.keys}}
                atomic_write(self.root / INDEX_NAME, (json.dumps(index, indent=2) + "\n").encode())
                written.append(INDEX_NAME)
        if not self.single:
            extra = dict(extra or {})
            for p in aux:
                if p.name != CONFIG_NAME and p.name not in extra:
                    with writing(self.root / p.name):
                        shutil.copyfile(p, self.root / p.name)
                    written.append(p.name)
            for name, doc in extra.items():
                data = doc if isinstance(doc, bytes) else (json.dumps(doc, indent=2) + "\n").encode()
                atomic_write(self.root / name, data)
                written.append(name)
            if config is not None and self.writer is not None:
                written.extend(write_hf_files(self.root, manifest, config))
            elif config is not None:
                atomic_write(self.root / CONFIG_NAME, (json.dumps(config, indent=2) + "\n").encode())
                written.append(CONFIG_NAME)
        fsync_path(self.root, directory=True)
        for name in self.old - set(written):  # the previous checkpoint's files (overwrite=True)
            (self.root / name).unlink(missing_ok=True)
        return [str(self.root / n) for n in written]

    def _existing(self) -> set[str]:
        if self.single or not self.dst.is_dir():
            return set()
        return {p.name for p in self.dst.iterdir()
                if p.is_file() and (p.suffix == ".safetensors" or p.name in _OWN_FILES)}

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()
        else:
            self.files.abort()


def _ignored_modules(plans: list[TensorPlan], source: Source) -> list[str]:
    """Every module an engine must leave in high precision, for its config: 2-D ``*.weight``
    tensors written unquantized (embeddings included), and an output head tied to the embedding (absent
    from the weights, or stored as an alias): engines build ``lm_head`` as a Linear and, unless
    it is named here, give it the quantized scheme with scales no file holds."""
    out = []
    for p in plans:
        n = p.name
        if p.step is not None and p.step.out_q is None and len(p.src.shape) == 2 and n.endswith(".weight") \
                and p.src.dtype.is_floating_point and "norm" not in n:
            out.append(n[: -len(".weight")])  # embeddings too: model-free tools treat every '*.weight' as targeted
    quantized = {p.name for p in plans if p.step is not None and p.step.out_q is not None}
    for p in plans:  # tied to another tensor (te-serial aliases): the alias's module is a module of its own
        a = p.src.alias_of
        if a is not None and p.name.endswith(".weight") and p.name not in quantized:
            out.append(p.name[: -len(".weight")])
    cfg = source.config if isinstance(source.config, dict) else {}
    tied = cfg.get("tie_word_embeddings", True) is not False
    if "lm_head.weight" not in quantized and "lm_head" not in out and tied \
            and "lm_head.weight" not in source.tensors:
        out.append("lm_head")  # a tied head: not in the weights, still a Linear in the model
    return sorted(set(out), key=out.index)


def _fill_expert_amax(acts: dict[str, float], modules: list[str]) -> list[str]:
    """Give each expert without a calibrated input amax (no token reached it, or only zeros) the
    largest of its layer's experts for the same projection, as engines serve one input scale per
    layer and projection (the max). Notes for the report."""
    from ..moe import expert_projection
    layers: dict[str, list[str]] = {}
    for m in modules:
        p = expert_projection(m)
        if p is not None:
            layers.setdefault(p, []).append(m)
    filled = 0
    for members in layers.values():
        known = [acts[m] for m in members if m in acts]
        if known and len(known) < len(members):
            for m in members:
                if m not in acts:
                    acts[m] = max(known)
                    filled += 1
    return [f"activations: {filled} experts had no calibrated input amax and take their layer's largest for the "
            "same projection (engines serve one input scale per layer, the max)"] if filled else []


def _config(spec: ExportSpec | None, family: str, source: Source, plans: list[TensorPlan],
            protos: Mapping[str, Any]) -> dict | None:
    """config.json for the output: the source's, with a quantization_config that matches the weights
    (``protos``: a te-serial output's prototypes, whose quantized ones make it te-serial's)."""
    base = without_te_serial_config(source.config) if isinstance(source.config, dict) else None
    if family in ("te", "plain"):
        if base is None:
            return None
        base.pop("quantization_config", None)
        return hf_config_for(base, protos) if family == "te" else base
    base = base or {}
    ignored = _ignored_modules(plans, source)
    if spec.mixed:
        base["quantization_config"] = spec.layout.mixed_config(spec.groups(), ignored, kv_cache=spec.kv_cache)
    else:
        [(scheme, mode, _)] = spec.groups()
        base["quantization_config"] = spec.layout.quantization_config(scheme, mode, ignored, kv_cache=spec.kv_cache)
    return base


# --- convert --------------------------------------------------------------------------------------

def _check_destination(src: Path, dst: Path, overwrite: bool, single: bool) -> None:
    try:
        same = dst.exists() and src.exists() and os.path.samefile(src, dst)
    except OSError:
        same = False
    if same or (src.is_dir() and dst.resolve() == src.resolve()):
        raise ConversionError("destination is the source; write the conversion elsewhere", file=str(dst))
    if single:
        if dst.is_dir():
            raise ConversionError("destination ends in .safetensors but is a directory", file=str(dst))
        if dst.exists() and not overwrite:
            raise ConversionError("destination exists (pass overwrite=True / --overwrite to replace it)",
                                  file=str(dst))
        return
    if dst.exists():
        if not dst.is_dir():
            raise ConversionError("destination exists and is not a directory", file=str(dst))
        if any(dst.iterdir()) and not overwrite:
            raise ConversionError("destination directory is not empty (pass overwrite=True / --overwrite)",
                                  file=str(dst))


def convert(src: str | os.PathLike, dst: str | os.PathLike, *, recipe: str | None = None,
            rules: Mapping[str, str] | Sequence[tuple[str, str]] | str | os.PathLike | None = None,
            dtype: torch.dtype | str = torch.bfloat16, max_shard_size: int | str = "5GB",
            report: str | os.PathLike | None = None, progress: ProgressFn | None = None,
            usages: str | None = None, overwrite: bool = False, activations: str | None = "auto",
            activation_amax: Mapping[str, float] | str | os.PathLike | None = None, stats: str = "full",
            device: str | torch.device | None = None, grouped: str | None = None,
            fused: str | Sequence[Sequence[str]] | None = "auto") -> ConversionReport:
    """Convert the checkpoint at ``src`` into ``dst``, streaming, and report what happened per tensor.

    ``src``: any layout te-serial reads, auto-detected — te-serial (any recipe), plain
    safetensors (one file, or shards with ``model.safetensors.index.json``), ModelOpt (NVFP4,
    MXFP8, FP8, FP8_PB_WO), compressed-tensors (FP8 per tensor or channel, NVFP4, MXFP8),
    DeepSeek-V3 block FP8; anything else raises :class:`~te_serial.UnknownLayoutError`.

    ``recipe``: the target of the default rule — a te-serial recipe (``mxfp8``, ``nvfp4_2d``, …,
    see :data:`te_serial.recipes.RECIPES`), ``bf16``/``fp16``/``fp32`` (a plain Hugging Face
    safetensors checkpoint), or a serving layout (:data:`TARGETS`: ``modelopt_nvfp4``,
    ``modelopt_mxfp8``, ``modelopt_fp8``, ``modelopt_fp8_pb_wo``, ``compressed_tensors_nvfp4``,
    ``compressed_tensors_mxfp8``, ``compressed_tensors_fp8`` (per-channel),
    ``compressed_tensors_fp8_tensor``, ``deepseek_fp8``), written with the ``config.json``
    ``quantization_config`` (and ModelOpt's ``hf_quant_config.json``) engines expect.
    ``None`` with no rules keeps every tensor (a layout conversion, e.g. DeepSeek → te-serial).

    ``activations`` (serving layouts): ``"auto"`` (static activation scales when every quantized
    layer has an activation amax — W8A8 / W4A4 —, else weight-only where the layout has it — W8A16
    / W4A16 —, else the layout's dynamic scheme), ``"weight_only"`` (``"none"``), ``"dynamic"`` or
    ``"static"``; the choice is printed in the report's notes and recorded in the config.
    ``activation_amax``: {module name: amax of its input} (or a JSON file of it, e.g. from
    :class:`ActivationAmax` over a calibration pass), on top of what the source records (TE
    delayed-scaling amax histories, a layout's static input scales).

    ``rules``: ``{glob pattern on tensor names: target or "keep"}`` (first match wins, unmatched
    tensors are kept), or a rules file. Default: 2-D ``*.weight`` tensors get ``recipe`` except
    embeddings, ``lm_head``, norms and MoE routers; everything else is kept.

    ``dtype``: nominal dtype of newly quantized tensors and dtype of dequantized ones.
    ``usages``: ``"rowwise"``, ``"columnwise"`` or ``"both"`` for te-serial recipe targets
    (default: the source tensor's usages if it is quantized, else both).
    ``dst``: a directory (te-serial shards + ``te_serial.msgpack``, or HF shards + index +
    ``config.json``), or a ``.safetensors`` file (te-serial or plain targets).
    ``report``: also save the report as JSON there. ``progress(done_bytes, total_bytes, name)``
    is called after each tensor, and once more with ``done_bytes == total_bytes`` at the end.

    ``stats``: how requantized tensors' error figures are measured — ``"full"`` (every element),
    ``"sample"`` (evenly spread row blocks, about 1/16 of the rows) or ``"none"``; lossless paths
    are verified in full whatever the mode, and the report says which mode each figure came from.
    ``grouped``: grouped (MoE) weights ``<p>.experts.<proj>.weight`` are ``"keep"``-ed (each member
    converted by the recipe), ``"split"`` into Hugging Face's per-expert tensors
    ``<p>.experts.<i>.<proj>.weight``, or per-expert tensors are ``"merge"``-d into grouped ones;
    exact either way. Default: keep for te-serial outputs, split for Hugging Face and serving layouts.
    ``fused``: the weights a serving engine fuses into one GEMM (q/k/v, gate/up, …: the table in
    :mod:`te_serial.fusion`, by ``config.json``'s architecture) are quantized with one shared tensor
    amax where the target's scale is tensor-wide (NVFP4's global scale, per-tensor FP8): the
    group's largest, so the engine's one scale is every member's. A member copied exactly whose
    scale is not the group's, into a serving layout: NVFP4 (whose global scale engines apply as
    they find it) is requantized with the shared amax, and the report says so per tensor, so such
    an export never holds an NVFP4 group with unequal scales; per-tensor FP8 keeps its bytes, as
    ModelOpt and llm-compressor write them (engines requantize a fused group to its largest scale
    at load), and the report gives per tensor how far that requantization moves its values.
    ``"shared"`` requantizes FP8 copies here too; ``"off"`` shares nothing and the report warns
    that engines will serve NVFP4 groups with wrong values; or give your own groups of module
    names (``[["wq", "wk", "wv"]]``).
    ``device``: where tensors are quantized (``"cuda"`` / ``"cpu"``; default CUDA when available);
    reading, converting and writing overlap (a three-stage pipeline) either way.
    """
    t0 = time.perf_counter()
    if stats not in STATS_MODES:
        raise ConversionError(f"stats must be one of {list(STATS_MODES)}, got {stats!r}", field="stats")
    dev = resolve_device(device)
    src_path, dst_path = Path(src), Path(dst)
    limit = parse_size(max_shard_size)
    out_dtype = _parse_dtype(dtype)
    with old_objects_frozen(), open_source(src_path, dtype=out_dtype) as source:
        source = _grouped_view(source, grouped, rules, recipe)
        family, spec, plans = plan_conversion(source, recipe=recipe, rules=rules, dtype=out_dtype, usages=usages,
                                              activations=activations, activation_amax=activation_amax, fused=fused)
        single = dst_path.suffix == ".safetensors"
        if single and spec is not None:
            raise ConversionError(f"{spec.name} is a model directory (config.json + safetensors); "
                                  "give a directory as destination", file=str(dst_path))
        _check_destination(src_path, dst_path, overwrite, single)
        rep = ConversionReport(str(src_path), str(dst_path), source.layout,
                               spec.name if spec is not None else FAMILY_LAYOUT[family], recipe,
                               stats=stats, device=str(dev))
        if spec is not None:
            rep.notes.append(spec.note)
        rep.notes.extend(share_fused_scales(source, plans, fused, spec))
        out = _Output(dst_path, family, plans, limit, source, _metadata(source, family, activation_amax))
        try:
            reports = _convert_all(source, plans, family, out, dev, stats, progress)
            if spec is not None:
                rep.notes.extend(check_fused_scales(spec, out.shared))
            reports.update(_dropped(source, spec))
            rep.files = _commit(out, source, spec, family, plans, single)
        except BaseException:
            out.abort()
            raise
        rep.tensors = [reports[p.name] for p in plans] + [reports[n] for n in reports if n not in out.planned]
        rep.notes.extend(_source_notes(source, spec, family, rep.tensors))
    rep.seconds = time.perf_counter() - t0
    if report is not None:
        rep.save(report)
    return rep


def _grouped_view(source: Source, grouped: str | None, rules, recipe: str | None) -> Source:
    """``source`` with its grouped (MoE) weights kept, split or merged (``convert``'s ``grouped``;
    default: kept for te-serial outputs, split for Hugging Face and serving layouts)."""
    if grouped is None:
        grouped = "keep" if Rules(load_rules(rules) if isinstance(rules, (str, os.PathLike)) else rules,
                                  recipe).family() == "te" else "split"
    if grouped not in GROUPED_MODES:
        raise ConversionError(f"grouped must be one of {list(GROUPED_MODES)}, got {grouped!r}", field="grouped")
    if grouped == "split":
        return split_experts(source)
    return source if grouped == "keep" else GroupedView(source, grouped)


def _metadata(source: Source, family: str, activation_amax) -> dict[str, str]:
    """A te-serial output's metadata: the source's, where it came from, and the activation amax."""
    if family != "te":
        return {}
    metadata = dict(source.metadata)
    metadata["te_serial.converted_from"] = source.layout
    acts = {**source.activation_amax, **_parse_amax(activation_amax)}
    if acts and source.layout != "te-serial" or activation_amax is not None:
        metadata[ACT_AMAX_KEY] = json.dumps({k: float(v).hex() for k, v in sorted(acts.items())})
    return metadata


#: pieces of one stored tensor (a stack's experts) are read together up to this many bytes at a time
PIECE_BATCH_BYTES = 64 << 20


def _batches(source: Source, plans: list[TensorPlan]) -> list[list[TensorPlan]]:
    """The pipeline's items: each tensor alone, except consecutive pieces of one stored tensor (a
    stack's experts written one by one), read together within :data:`PIECE_BATCH_BYTES`."""
    out: list[list[TensorPlan]] = []
    last, held = None, 0
    for p in plans:
        whole = source.piece_of(p.name)
        if whole is not None and whole == last and held + p.src.nbytes <= PIECE_BATCH_BYTES:
            out[-1].append(p)
            held += p.src.nbytes
        else:
            out.append([p])
            held = p.src.nbytes
        last = whole
    return out


def _member_parts(batch: list[TensorPlan], out: "_Output") -> list[list[TensorPlan]]:
    """``batch``, or, where it is one expert stack of a te-serial output larger than
    :data:`PIECE_BATCH_BYTES` that a byte relayout converts member by member, its ranges of experts
    within that size, each an item of its own: the stack's writing starts with its first experts, and
    one range is held at a time, not the stack. Each member's bytes are what the whole would give it."""
    plan = batch[0]
    step, sq = plan.step, plan.src.quantizer
    q = step.out_q if step is not None else None
    if (len(batch) != 1 or out.writer is None or plan.alias_of is not None or plan.nbytes <= PIECE_BATCH_BYTES
            or step.builder != "exact" or step.requant or step.data_dependent
            or sq is None or q is None or not (sq.is_container and q.is_container)
            or sq.member_shapes != q.member_shapes or len(set(q.member_shapes)) != 1
            or len(q.group_shape) != 3):   # a 3-D stack: a range's quantizer widens back (of_whole)
        return [batch]
    n = q.num_tensors
    per = max(1, n * PIECE_BATCH_BYTES // plan.nbytes)
    return [[_member_plan(plan, a, min(a + per, n))] for a in range(0, n, per)]


def _member_plan(plan: TensorPlan, start: int, stop: int) -> TensorPlan:
    """The plan of members ``start`` .. ``stop - 1`` of a stack's plan (:func:`_member_parts`): their
    source, their output format, and their part of each output buffer."""
    st, n = plan.src, plan.src.quantizer.num_tensors
    src_q = st.quantizer.member_span(start, stop)[0]
    out_q, where = plan.step.out_q.member_span(start, stop)
    src = dataclasses.replace(st, proto=dataclasses.replace(st.proto, shape=src_q.group_shape, quantizer=src_q),
                              nbytes=st.nbytes * stop // n - st.nbytes * start // n)
    dtypes = {k: d for k, _, d in plan.keys}
    keys = [(buffer_key(plan.name, b), (count,), dtypes[buffer_key(plan.name, b)]) for b, (_, count) in where.items()]
    return dataclasses.replace(plan, src=src, step=dataclasses.replace(plan.step, out_q=out_q), keys=keys,
                               members=(start, stop))


_LABEL_ORDER = {LOSSLESS: 0, EXACT_CODES: 1, LOSSY: 2}


def _joined_report(plan: TensorPlan, parts: list[TensorReport], family: str) -> TensorReport:
    """The report of a stack converted a range of experts at a time (:func:`_member_parts`): its parts'
    worst figures (each already the worst of its members', as the whole's is), bytes summed, each
    note once."""
    worst = max(parts, key=lambda r: _LABEL_ORDER.get(r.label, 3))
    routes: dict[str, float] = {}
    for r in parts:
        for k, v in r.routes.items():
            routes[k] = max(v, routes.get(k, v))
    notes = "; ".join(dict.fromkeys(r.note for r in parts if r.note))
    step = plan.step
    return dataclasses.replace(
        worst, name=plan.name, shape=plan.src.shape, source=_src_fmt(plan.src),
        target=_fmt(step.out_q, step.out_dtype, family, plan.export, plan.name),
        max_abs_err=max(r.max_abs_err for r in parts), rel_rmse=max(r.rel_rmse for r in parts),
        snr_db=min(r.snr_db for r in parts), src_bytes=sum(r.src_bytes for r in parts),
        dst_bytes=sum(r.dst_bytes for r in parts), note=notes, ulp_max=max(r.ulp_max for r in parts),
        ulp_elements=sum(r.ulp_elements for r in parts), routes=routes)


def _batched_loader(source: Source, plans: list[TensorPlan]) -> Callable[[str], torch.Tensor]:
    """``source.load``, except that a piece of a stored tensor comes with the rest of its batch
    (:func:`_batches`), read together and held until a tensor outside the batch is asked for."""
    batch_of = {p.name: b for b in _batches(source, plans) if len(b) > 1 for p in b}
    held: dict[str, torch.Tensor] = {}

    def load(name: str) -> torch.Tensor:
        if name in held:
            return held[name]
        held.clear()
        batch = batch_of.get(name)
        if batch is None:
            return source.load(name)
        names = [p.name for p in batch]
        held.update(zip(names, source.load_pieces(names)))
        return held[name]
    return load


def _convert_all(source: Source, plans: list[TensorPlan], family: str, out: "_Output", dev: torch.device,
                 stats: str, progress: ProgressFn | None) -> dict[str, TensorReport]:
    """Every tensor read, converted and written (three overlapping stages), one at a time (a stack's
    experts a batch at a time); a tied tensor reported as its partner. The reports by name."""
    total, done = source.nbytes, 0
    reports: dict[str, TensorReport] = {}
    if progress is not None:
        progress(0, total, "")

    def read(batch: list[TensorPlan]) -> tuple[torch.Tensor | None, list[tuple[torch.Tensor | None, Callable[[], None] | None]]]:
        """(a stack's pieces joined, read at once, or None; each piece and its check (None for the
        joined, whose check comes with the batch's last piece))."""
        names = [p.name for p in batch]
        if batch[0].members is not None:  # a range of a stack's experts (:func:`_member_parts`): those bytes only
            t, check = _guarded(source, batch[0], lambda: source.stream_members(names[0], *batch[0].members))
            return None, [(t, check)]
        if any(_computes(p.step) for p in batch):
            pieces = _guarded(source, batch[0], lambda: source.load_pieces(names))
            return None, [(to_device(t, dev) if _computes(p.step) else t, None) for p, t in zip(batch, pieces)]
        # byte relayouts: the source's pages go to the output as they are, checked once the batch is written
        if len(batch) > 1 and _joinable(batch, out):
            got = _guarded(source, batch[0], lambda: source.stream_joined(names))
            if got is not None:
                return got[0], [(None, None)] * (len(batch) - 1) + [(None, got[1])]
        pieces, check = _guarded(source, batch[0], lambda: source.stream_pieces(names))
        return None, [(t, check if i == len(pieces) - 1 else None) for i, t in enumerate(pieces)]

    def compute(batch: list[TensorPlan], read) -> list[tuple[torch.Tensor, Callable[[], None] | None]]:
        nonlocal done
        joined_src, items = read
        joined = None
        if joined_src is not None:
            joined = _guarded(source, batch[0], lambda: _export_joined(source, batch, joined_src, out, stats))
            if joined is None:   # not the same as one by one after all: the pieces, cut from the joined rows
                items = [(t, check) for t, (_, check) in zip(_cut_rows(joined_src, batch), items)]
        results = []
        for i, (plan, (src, check)) in enumerate(zip(batch, items)):
            if joined is not None:
                result, reports[plan.name] = joined[i]
            elif plan.members is not None:
                result, rep, _ = _guarded(source, plan, lambda: convert_tensor(source, plan, family, src=src, stats=stats))
                member_reports.setdefault(plan.name, []).append(rep)
            else:
                result, reports[plan.name], _ = _guarded(
                    source, plan, lambda: convert_tensor(source, plan, family, src=src, stats=stats))
                if result.device == CPU:  # a device's result goes to the CPU on the writer's thread, overlapped
                    result = _guarded(source, plan, lambda: out.prepare(plan, result))
            results.append((result, check))
            if plan.src.alias_of is None:
                done += plan.src.nbytes
            if progress is not None:
                progress(done, total, plan.name)
        return results

    def write(batch: list[TensorPlan], items) -> None:
        for plan, (result, check) in zip(batch, items):
            if isinstance(result, torch.Tensor) and result.device != CPU:
                result = _guarded(source, plan, lambda: out.prepare(plan, to_device(result, CPU)))
            _guarded(source, plan, lambda: out.write(plan, result))
            if check is not None:  # before anything is committed
                _guarded(source, plan, check)

    batches = [part for b in _batches(source, [p for p in plans if p.alias_of is None]) for part in _member_parts(b, out)]
    member_reports: dict[str, list[TensorReport]] = {}

    def size(batch: list[TensorPlan]) -> int:
        return sum(map(_output_bytes, batch))

    run_pipeline(batches, read, compute, write, size=size,
                 write_budget=3 * max(map(size, batches), default=0) // 2)
    for plan in plans:
        if plan.name in member_reports:
            reports[plan.name] = _joined_report(plan, member_reports[plan.name], family)
    for plan in plans:
        if plan.alias_of is not None:
            st, ref = plan.src, reports.get(plan.alias_of)
            reports[plan.name] = TensorReport(plan.name, st.shape, _src_fmt(st), plan.target, "tied",
                                              ref.label if ref else LOSSLESS,
                                              ref.max_abs_err if ref else 0.0, ref.rel_rmse if ref else 0.0,
                                              ref.snr_db if ref else math.inf, 0, 0, f"tied to {plan.alias_of}")
    if progress is not None:
        progress(total, total, "")
    return reports


def _joinable(batch: list[TensorPlan], out: "_Output") -> bool:
    """Do a stack's pieces (a batch of :func:`_batches`) go into the output as one tensor cut by rows
    (:func:`_export_joined`)? Byte relayouts, by one step, into a serving scheme its layout writes row by
    row (``row_local``: row-block scales, no per-tensor value), without activation or shared scales."""
    first = batch[0]
    spec, step = first.export, first.step
    if spec is None or out.files is None or _computes(step) or not step.exact:
        return False
    scheme = spec.scheme_of(first.name)
    keys = {k for k, _, _ in first.keys}
    if scheme not in spec.layout.row_local or spec.mode_of(first.name) == "static" \
            or (first.name in spec.schemes
                and any(prefix(first.name) + k in keys for k in spec.shared_scale_keys(first.name, step.out_q))):
        return False
    return all(p.export is spec and p.step == step and spec.scheme_of(p.name) == scheme for p in batch)


def _cut_rows(joined: torch.Tensor, batch: list[TensorPlan]) -> list[torch.Tensor]:
    """The pieces of ``batch`` from their rows joined (exact: the format's row slicing)."""
    out, at = [], 0
    for p in batch:
        rows = p.src.shape[0]
        out.append(slice_quantized(joined, rows=(at, at + rows)))
        at += rows
    return out


def _export_joined(source: Source, batch: list[TensorPlan], joined: torch.Tensor, out: "_Output",
                   stats: str) -> list[tuple[Any, TensorReport]] | None:
    """A stack's pieces (:func:`_joinable`), read as one tensor of their rows joined, converted and
    exported as one, then each output buffer cut back into the pieces' planned keys by rows: the same
    bytes and reports as piece by piece, without the per-piece work (thousands of experts). Per piece
    (what it writes, its report); None where any of that does not hold (the caller then goes piece by
    piece)."""
    first = batch[0]
    spec = first.export
    if getattr(source, "import_checks", {}).keys() & {p.name for p in batch} \
            or not isinstance(joined, QuantizedTensorStorage) or joined.device != CPU \
            or joined.quantizer != first.src.quantizer \
            or tuple(joined.logical_shape) != (sum(p.src.shape[0] for p in batch), *first.src.shape[1:]):
        return None
    src = dataclasses.replace(first.src, proto=dataclasses.replace(first.src.proto, shape=tuple(joined.logical_shape)),
                              nbytes=sum(p.src.nbytes for p in batch))
    result, rep, _ = convert_tensor(source, dataclasses.replace(first, src=src), out.family, src=joined, stats=stats)
    if rep.label != LOSSLESS or not isinstance(result, QuantizedTensorStorage):
        return None
    blobs = export_buffers(out.family, first.name, result, spec)
    runs: dict[str, list[str]] = {k: [] for k in blobs}   # joined key → the pieces' keys it holds, in order
    parts: dict[str, torch.Tensor] = {}
    at = dict.fromkeys(blobs, 0)
    for p in batch:
        for key, kshape, kdtype in p.keys:
            joined_key = _renamed_key(key, p.name, first.name)
            big = blobs.get(joined_key)
            if big is None or big.dtype != kdtype or not kshape or tuple(big.shape[1:]) != tuple(kshape[1:]) \
                    or at[joined_key] + kshape[0] > big.shape[0]:
                return None
            parts[key] = big.narrow(0, at[joined_key], kshape[0])
            at[joined_key] += kshape[0]
            runs[joined_key].append(key)
    if any(at[k] != t.shape[0] for k, t in blobs.items()):
        return None   # a buffer that is not the pieces' rows stacked (a per-tensor scale): piece by piece
    entry = sidecar_entry(result, first.src.quantizer)
    done: list[tuple[Any, TensorReport]] = []
    for p in batch:
        out.record(p, dict(entry), {key: parts[key] for key, _, _ in p.keys})
        # the first piece carries the whole batch's writes (one per joined buffer), the others none
        written = _Runs([(keys, blobs[k]) for k, keys in runs.items()], parts) if not done else {}
        done.append((written, dataclasses.replace(rep, name=p.name, shape=p.src.shape, src_bytes=p.src.nbytes,
                                                  dst_bytes=p.nbytes, routes=dict(rep.routes))))
    return done


@dataclasses.dataclass
class _Runs:
    """A joined stack's output (:func:`_export_joined`): runs of (the pieces' keys, the tensor holding
    their bytes in that order), written with one write each where the files lay them out so
    (:func:`_file_order`), and each key's own tensor for where they do not."""

    runs: list[tuple[list[str], torch.Tensor]]
    parts: dict[str, torch.Tensor]


def _file_order(source: Source, plans: list[TensorPlan]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The output buffers in file order: the plans' keys in order, except that the pieces of one stored
    tensor batched together (:func:`_batches`) lay out each of their buffers one after another (every
    piece's weight, then every piece's scale…), so a joined stack writes each with one write."""
    batch_of = {id(p): b for b in _batches(source, [p for p in plans if p.alias_of is None])
                if len(b) > 1 and len({len(q.keys) for q in b}) == 1 for p in b}
    order = []
    for p in plans:
        batch = batch_of.get(id(p))
        if batch is None:
            order.extend(p.keys)
        elif p is batch[0]:
            order.extend(q.keys[j] for j in range(len(p.keys)) for q in batch)
    return order


def _renamed_key(key: str, name: str, new: str) -> str:
    """Output key ``key`` of tensor ``name``, as tensor ``new``'s (``<name>…`` or ``<prefix>…``)."""
    if key.startswith(name):
        return new + key[len(name):]
    return prefix(new) + key[len(prefix(name)):] if key.startswith(prefix(name)) else key


def _dropped(source: Source, spec: ExportSpec | None) -> dict[str, TensorReport]:
    """Reports of what the output leaves out: a layout's activation scales, TE module state."""
    dropped = {name: (source.info(name)[1], "activation scale", reason, nbytes)
               for name, (reason, nbytes) in source.dropped.items()}
    for name in (spec.dropped if spec is not None else ()):
        st = source.tensors[name]
        dropped[name] = (st.shape, _src_fmt(st), "TE module state (scales, amax history): not a weight; "
                         "its amax history gives the layer's activation amax", st.nbytes)
    return {name: TensorReport(name, shape, what, "-", "drop", DROPPED, src_bytes=nbytes, note=reason)
            for name, (shape, what, reason, nbytes) in dropped.items()}


def _commit(out: "_Output", source: Source, spec: ExportSpec | None, family: str, plans: list[TensorPlan],
            single: bool) -> list[str]:
    """Commit the written tensors with config.json, a layout's own files and the export sidecar
    (a single file carries none of them); the files written."""
    config = None if single else _config(spec, family, source, plans,
                                         out.writer.protos if out.writer is not None else {})
    aux = source.aux_files if source.path.is_dir() and not single else []
    extra = {}
    if spec is not None:
        qc = config["quantization_config"] if config is not None else {}
        ignored = qc.get("ignore", qc.get("exclude_modules", qc.get("ignored_layers", [])))
        extra.update(spec.layout.extra_files(spec.groups(), ignored, kv_cache=spec.kv_cache))
        extra[SIDECAR_NAME] = write_sidecar(out.sidecar, spec.activation_amax)
    return out.commit(config, aux, extra)


def _source_notes(source: Source, spec: ExportSpec | None, family: str, tensors: list[TensorReport]) -> list[str]:
    """The report's closing notes: routes that round scales, what the source had that the output
    cannot hold, the import's own notes."""
    notes = _route_notes(tensors)
    if source.tree is not None and family != "te":
        notes.append("the te-serial checkpoint's non-tensor values (its tree) are not kept in safetensors")
    notes.extend(f"{name}: {note}" for name, note in source.notes.items())
    if spec is not None and source.config is None:
        notes.append("the source has no config.json: the written config.json holds only quantization_config")
    return notes


def share_fused_scales(source: Source, plans: list[TensorPlan], fused, spec: ExportSpec | None,
                        measure: bool = True) -> list[str]:
    """Give each fused group one tensor amax (:mod:`.fused_scales`), rewriting its members' steps;
    the report's notes. Reads each member once before the conversion proper (``measure``: and a
    copied member that keeps its own scale once more, for its report's route)."""
    groups = groups_for(architecture_of(source.config), fused)
    if not groups:
        return []
    by_name = {p.name: p for p in plans if p.alias_of is None and p.step is not None}
    load = _batched_loader(source, list(by_name.values()))
    changed, notes = share_fused_amax(lambda n: _guarded(source, by_name[n], lambda: load(n)),
                                      {n: p.step for n, p in by_name.items()}, groups, rule=fused,
                                      reexpress=spec is not None, measure=measure)
    for name, step in changed.items():
        by_name[name].step = step
    return notes


def check_fused_scales(spec: ExportSpec, shared: Mapping[str, Mapping[str, torch.Tensor]],
                        only: str | None = None) -> list[str]:
    """Refuse (or with ``fused="off"`` warn about) a fused group written with unequal tensor scales:
    an engine applies one to the fused weight, so every member but one would be served wrong.
    ``only``: check just the group holding this tensor."""
    notes = []
    for members in spec.fused:
        if only is not None and only not in members:
            continue
        for key in sorted({k for m in members for k in shared.get(m, {})}):
            vals = [shared.get(m, {}).get(key) for m in members]
            if any(v is None for v in vals):
                continue
            if len({bytes(v.reshape(-1).contiguous().view(torch.uint8).numpy()) for v in vals}) == 1:
                continue
            said = ", ".join(f"{prefix(m)}{key} = {float(v.reshape(-1)[0]):.6g}" for m, v in zip(members, vals))
            text = (f"fused group {', '.join(module_of(m) for m in members)} has unequal {key} ({said}): serving "
                    "engines fuse these into one GEMM with one scale, so they will serve wrong values")
            if spec.fused_enforced:
                raise ConversionError(text + "; the members were quantized in different formats or their scales "
                                      "could not be shared", tensor=members[0])
            notes.append("WARNING: " + text + " (fused='off')")
    return notes


def _route_notes(tensors: Sequence[TensorReport]) -> list[str]:
    """One line per consumer route that reads some tensors as other values (rounded scales, an
    engine's requantization): how many, how far."""
    worst: dict[str, list[float]] = {}
    for t in tensors:
        for route, err in t.routes.items():
            worst.setdefault(route, []).append(err)
    return [f"NOT lossless through {route}: {len(errs)} weights are read there as other values, which move by up "
            f"to {max(errs):.3g}; the files hold the exact values every other route reads"
            for route, errs in worst.items()]


def _same_usage_bytes(a: QuantizedTensorStorage, b: QuantizedTensorStorage, usage: str) -> bool:
    """Do ``a`` and ``b`` hold ``usage`` in one layout with the same bytes (so the same values,
    whatever they are: no dequantize needed to say so)?"""
    def only(q):
        return q.set_usage(rowwise=usage == ROW, columnwise=usage != ROW)
    qa, qb = only(a.quantizer), only(b.quantizer)
    if qa.layout_key() != qb.layout_key() or tuple(a.logical_shape) != tuple(b.logical_shape):
        return False
    ba, bb = qa.usage_buffers(a.buffers(), usage), qb.usage_buffers(b.buffers(), usage)
    return set(ba) == set(bb) and all(_same_bytes(ba[n], bb[n]) for n in ba)


def _same_bytes(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Equal shapes and bytes (one view of the same memory holds them without a compare)."""
    if x.shape != y.shape or x.dtype.itemsize != y.dtype.itemsize:
        return False
    if x.device == y.device and x.data_ptr() == y.data_ptr() and x.stride() == y.stride():
        return True
    return torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))


def _compare_members(src: torch.Tensor, result: QuantizedTensorStorage) -> ErrorStats | None:
    """A grouped result against its source, one member at a time in the member's own (stored)
    orientation: a grouped source's members, or a plain stack's (views): no copy of a transposed
    stack's values, and no stack-sized values at once. The worst member's figures; None where the
    two are not such a pair."""
    sq, rq = getattr(src, "quantizer", None), result.quantizer
    if not (rq.is_container and rq.member is not None):
        return None
    if sq is None:
        if tuple(src.shape) != tuple(result.logical_shape):
            return None
        pairs = zip(rq.split_values(src), result.members())
    elif sq.is_container and sq.member is not None and sq.member_shapes == rq.member_shapes:
        pairs = ((values(a), b) for a, b in zip(src.members(), result.members()))
    else:
        return None
    stats = None
    for a, b in pairs:
        s = compare(a, values(b))
        stats = s if stats is None else stats.worst(s)
    return stats


def _output_bytes(plan: TensorPlan) -> int:
    """The bytes a plan's output buffers hold (what its result keeps alive until written)."""
    return sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in plan.keys)


def tensor_plan(st: SourceTensor, step: Step, family: str = "te") -> TensorPlan:
    """One tensor's plan for ``step`` (output format name and buffers), as :func:`plan_conversion` makes it
    (for callers that choose the step themselves, e.g. ``load_into`` quantizing on the fly)."""
    return TensorPlan(st.name, st, step, _fmt(step.out_q, step.out_dtype, family),
                      _layout(family, st.name, st.shape, step, None))


def _guarded(source: Source, plan: TensorPlan, fn: Callable[[], Any]) -> Any:
    """Run one stage of one tensor's conversion; errors name the tensor and its file."""
    try:
        return fn()
    except CheckpointError:
        raise  # the reader's own error (file, tensor, field), whatever reads it
    except TeSerialError as e:
        raise ConversionError(str(e), file=_file_of(source, plan.src), tensor=plan.name) from e
    except (RuntimeError, ValueError, TypeError, OSError, MemoryError) as e:
        raise ConversionError(f"{type(e).__name__}: {e}", file=_file_of(source, plan.src), tensor=plan.name) from e


def _computes(step: Step) -> bool:
    """Does this step quantize (the work a GPU speeds up)? Byte relayouts stay on the CPU."""
    return step.builder in ("quantize", "per_channel") or bool(step.requant)


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``convert``'s compute device: CUDA when available unless told; a clear error for one that is not there."""
    if device is None:
        return torch.device("cuda") if torch.cuda.is_available() else CPU
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConversionError(f"not a device: {device!r} ({e})", field="device") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConversionError(f"device {device!r}: CUDA is not available here; use device='cpu'", field="device")
    if dev.type not in ("cpu", "cuda"):
        raise ConversionError(f"device {device!r}: convert runs on 'cpu' or 'cuda'", field="device")
    return dev


def convert_tensor(source: Source, plan: TensorPlan, family: str = "te",
                   src: torch.Tensor | None = None, stats: str = "full") -> tuple[torch.Tensor, TensorReport, TensorProto]:
    """The per-tensor step of :func:`convert` (and of ``load_into`` quantizing on the fly): read the
    tensor (or take ``src``, already read), run the plan's step, check the result against the
    source. Returns (output tensor, its report, its prototype). ``stats``: how a requantized
    tensor's error figures are measured (:data:`STATS_MODES`); every other path is checked in full."""
    st, step = plan.src, plan.step
    src = source.load(plan.name) if src is None else src
    cache: dict[str, torch.Tensor] = {}

    def x_fn() -> torch.Tensor:
        if "x" not in cache:
            cache["x"] = values(src)
        return cache["x"]

    result, step = execute(step, src, x_fn)
    proto = TensorProto(st.shape, step.out_dtype, step.out_q if isinstance(result, QuantizedTensorStorage) else None)
    target_fmt = _fmt(proto.quantizer, step.out_dtype, family, plan.export, plan.name)
    quantized_src = isinstance(src, QuantizedTensorStorage)
    primary = x_fn if quantized_src else (lambda: src)  # a plain source is compared as it is (no copy)
    spec = plan.export
    checks = [c for c in (getattr(source, "import_checks", {}).get(plan.name),) if c is not None]
    if step.builder == "keep":
        stats = ErrorStats(True)
    elif spec is not None and step.exact and isinstance(result, QuantizedTensorStorage) \
            and result.quantizer.global_scale_divisor() is not None:
        # A two-level weight written into a serving layout: its codes and block scales are the
        # source's bytes (a copy, or tile scales spread by the format's own derive), so te-serial's
        # values are the source's; what can differ is the layout reader's way of applying the tensor
        # scale — measured per (block scale, code) pair, without a pass over the elements.
        scheme = spec.scheme_of(plan.name)
        reader = spec.layout.reader(scheme, spec.layout.export(plan.name, result, scheme), plan.name)
        checks.append(codes_check(result, reader))
        stats = ErrorStats(True)
    elif not isinstance(result, QuantizedTensorStorage):
        stats = compare(primary(), result)
    else:
        # A usage built from the source's bytes is compared with the source's same usage (when it has
        # one); a requantized usage with the values it was quantized from (the source's primary ones).
        requantized = step.builder in ("quantize", "per_channel")
        if not requantized and not step.requant:
            cache.clear()
        measured = stats if requantized or step.requant else "full"   # exact paths: always in full
        if measured == "full" and quantized_src and all(src.quantizer.derives_by_table(result.quantizer, u)
                                                        for u in result.quantizer.conversion_usages()):
            stats = ErrorStats(True)   # each value by the source format's table: exact for any bytes
        elif measured == "none":
            stats = ErrorStats(False, math.nan, math.nan, math.nan)
        else:
            rows = (sample_rows if measured == "sample" else all_rows)(st.shape, result, src)
            found: list[ErrorStats] = []
            from_primary = []  # usages compared with the primary values: one pass over them for all
            for u in enabled(result.quantizer):
                src_has = quantized_src and (src.quantizer.rowwise if u == ROW else src.quantizer.columnwise)
                out_u = functools.partial(values, result, u)   # out_u(rows): those rows' values
                if src_has and not (requantized or u in step.requant):
                    if _same_usage_bytes(src, result, u):  # the same layout holding the same bytes
                        found.append(ErrorStats(True))
                        continue
                    found += compare_rows(functools.partial(values, src, u), [out_u], rows)
                else:
                    from_primary.append(out_u)
            if from_primary:
                found += compare_rows(lambda r: rows_of(primary(), r), from_primary, rows)
            stats = None
            for s in found:
                stats = s if stats is None else stats.worst(s)
            if stats is None:  # no 2-D usage of its own (a grouped tensor): member by member, or as a whole
                stats = _compare_members(src, result) or compare(primary(), values(result))
        if measured != "full":
            stats.sampled = measured
    note = step.note
    if step.exact or step.method in ("cast", "dequantize"):
        label = LOSSLESS if stats.exact else LOSSY
        if step.exact and not stats.exact:
            note = (note + "; " if note else "") + "expected an exact path but the values differ (source " \
                   "buffers are not what their format's layout promises)"
    else:
        label = LOSSY  # a requantized tensor is lossy by its path, whatever this data did
        if stats.exact and stats.sampled == "full":
            note = (note + "; " if note else "") + "requantized, and these values came out bit-identical"
    if label == LOSSLESS:
        stats = ErrorStats(True)
    ulp_max = ulp_elements = 0
    if label == LOSSLESS and any(c.ulp_max for c in checks):
        # reader → te-serial (an import) and te-serial → reader (an export) add up at most
        ulp_max = sum(c.ulp_max for c in checks)
        ulp_elements = max(c.ulp_elements for c in checks)
        label = EXACT_CODES
        stats = ErrorStats(False, sum(c.max_abs_err for c in checks), 0.0, math.inf)
        note = (note + "; " if note else "") + (
            f"codes and block scales byte-identical; the layout's reader applies the global scale with its own "
            f"formula: values within {ulp_max} fp32 ulp of te-serial's on at most {ulp_elements} elements")
    route = spec.layout.rounding_route(spec.scheme_of(plan.name), result) \
        if spec is not None and isinstance(result, QuantizedTensorStorage) else None
    rep = TensorReport(plan.name, st.shape, _src_fmt(st), target_fmt, step.method, label, stats.max_abs_err,
                       stats.rel_rmse, stats.snr_db, st.nbytes, plan.nbytes, note, ulp_max, ulp_elements,
                       stats.sampled)
    if route is not None:  # the files hold the values above; this reader gets others
        rep.routes[route[0]] = route[1]
    rep.routes.update(step.routes)
    return result, rep, proto
