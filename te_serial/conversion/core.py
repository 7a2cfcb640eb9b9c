"""``convert``: any checkpoint te-serial reads → any recipe or layout it writes, one tensor at a time.

The conversion is planned before any byte is read: each tensor's path (keep, exact relayout,
requantize, dequantize…) and every output buffer's key, shape and dtype follow from the source's
data-free prototypes and the rules. The output files are laid out from that plan, so each tensor
is read, converted, checked against its source, written at its offset and freed before the next
one: memory is set by the largest tensor, not by the checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from ..checkpoint.manifest import MANIFEST_NAME, SELF_FILE, buffer_key, expected_buffers
from ..checkpoint.files import ShardSet, atomic_write, fsync_path
from ..checkpoint.writer import CheckpointWriter, parse_size
from ..dtypes import dtype_from_name
from ..errors import CheckpointError, ConversionError, FormatError, ShapeError, TeSerialError
from ..formats.base import QuantizedTensorStorage
from ..proto import TensorProto
from .report import DROPPED, LOSSLESS, LOSSY, ConversionReport, TensorReport
from .sources import CONFIG_NAME, INDEX_NAME, Source, SourceTensor, open_source
from .targets import (FAMILY_LAYOUT, KEEP, Rules, describe_dtype, describe_quantizer, load_rules, target,
                      usage_label)
from .transforms import (ROW, E4M3, ErrorStats, Step, compare, enabled, execute, plan_ct, plan_deepseek,
                         plan_keep_external, plan_plain, plan_te, values)

__all__ = ["convert", "plan_conversion", "TensorPlan"]

ProgressFn = Callable[[int, int, str], Any]


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


def _fmt(q, dtype: torch.dtype, family: str) -> str:
    if q is None:
        return describe_dtype(dtype)
    if family == "deepseek":
        return "deepseek_fp8"
    if family == "ct":
        return "ct_fp8_tensor" if q.scale_per_tensor else "ct_fp8_channel"
    return f"{describe_quantizer(q)}/{usage_label(q)}"


def _src_fmt(st: SourceTensor) -> str:
    if st.quantizer is None or st.fmt in ("deepseek_fp8", "ct_fp8_tensor", "ct_fp8_channel"):
        return st.fmt
    return f"{st.fmt}/{st.usages}"


def _keep(st: SourceTensor, note: str = "") -> Step:
    return Step("keep", st.quantizer, st.dtype, exact=True, builder="keep", note=note)


def _plan_step(st: SourceTensor, value: str, explicit: bool, family: str, dtype: torch.dtype,
               usages: tuple[bool, bool] | None, strategy: str | None, src_file: str) -> Step:
    name, shape = st.name, st.shape
    if value == KEEP:
        if family == "te":
            return _keep(st)
        return plan_keep_external(family, st.quantizer, st.dtype, dtype, strategy, st.uniform_rows, shape)
    t = target(value)
    if st.quantizer is None and not st.dtype.is_floating_point:
        step = _keep(st, "not floating point: kept as it is")
        if family != "te":
            step = plan_keep_external(family, None, st.dtype, dtype, strategy, False, shape)
            step = dataclasses.replace(step, note="not floating point: kept as it is")
        return step

    def refuse(why: str) -> Step:
        if explicit:
            raise ConversionError(f"rule target {value!r}: {why}; add a 'keep' rule for it before this one",
                                  file=src_file, tensor=name)
        if family == "te":
            return _keep(st, f"kept: {why}")
        step = plan_keep_external(family, st.quantizer, st.dtype, dtype, strategy, st.uniform_rows, shape)
        return dataclasses.replace(step, note=f"kept: {why}")

    if t.family == "plain":
        return plan_plain(st.quantizer, st.dtype, t.dtype)
    if t.family == "te":
        use = usages or ((st.quantizer.rowwise, st.quantizer.columnwise) if st.quantizer is not None else (True, True))
        q = t.quantizer(rowwise=use[0], columnwise=use[1])
        try:
            q.check_shape(shape)
        except ShapeError as e:
            return refuse(str(e))
        return plan_te(st.quantizer, q, dtype, st.dtype)
    if len(shape) != 2 or not (name == "weight" or name.endswith(".weight")):
        return refuse(f"{t.name} holds 2-D '*.weight' tensors only (got shape {list(shape)})")
    if t.family == "deepseek":
        return plan_deepseek(st.quantizer, dtype, st.dtype)
    return plan_ct(st.quantizer, t.strategy, dtype, st.dtype, st.uniform_rows)


def _layout(family: str, name: str, shape: tuple[int, ...], step: Step,
            strategy: str | None) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    q = step.out_q
    if q is None:
        return [(name, shape, step.out_dtype)]
    if family == "te":
        return [(buffer_key(name, b), s, d) for b, (s, d) in expected_buffers(step.proto(shape)).items()]
    # DeepSeek / compressed-tensors: the rowwise data, and the scale grid (DeepSeek: one per
    # 128×128 tile; compressed-tensors: one per tensor, or one per row)
    data = (name, shape, q.value_dtypes()[q.usage_layout(ROW).data])
    if family == "deepseek":
        return [data, (name + "_scale_inv", q.grid_shape(shape, ROW), torch.float32)]
    scale_shape = (1,) if q.scale_per_tensor else (shape[0], 1)
    return [data, (name[: -len("weight")] + "weight_scale", scale_shape, torch.float32)]


def _export(family: str, name: str, out: torch.Tensor) -> dict[str, torch.Tensor]:
    if not isinstance(out, QuantizedTensorStorage):
        return {name: out}
    q, b = out.quantizer, out.buffers()
    if family == "te":
        vals = q.value_dtypes()
        return {buffer_key(name, n): t.view(vals[n]) for n, t in b.items()}
    lay = q.usage_layout(ROW)
    data = b[lay.data].view(q.value_dtypes()[lay.data])
    grid = q.block_scales(b, tuple(out.logical_shape), ROW)  # valid region only, [row blocks, col blocks]
    if family == "deepseek":
        return {name: data, name + "_scale_inv": grid.contiguous()}
    scale = grid.reshape(1).clone() if q.scale_per_tensor else grid[:, :1].contiguous()  # channel: rows share one
    return {name: data, name[: -len("weight")] + "weight_scale": scale}


def _file_of(source: Source, st: SourceTensor) -> str:
    entry = st.keys.get("entry")
    if entry is not None:
        b = next(iter(entry.buffers.values()), None)
        root = source.path if source.path.is_dir() else source.path.parent
        return str(source.path if b is None or b.file == SELF_FILE else root / b.file)
    key = st.keys.get("data") or st.keys.get("weight")
    where = getattr(source, "_where", {})
    return where.get(key, str(source.path))


def plan_conversion(source: Source, *, recipe: str | None = None, rules=None, dtype: torch.dtype | str = torch.bfloat16,
                    usages=None) -> tuple[str, str | None, list[TensorPlan]]:
    """(output family, compressed-tensors strategy, per-tensor plans) — no data is read."""
    if isinstance(rules, (str, os.PathLike)):
        rules = load_rules(rules)
    r = Rules(rules, recipe)
    family = r.family()
    strategies = {target(v).strategy for v in r.values() if target(v).family == "ct"}
    if len(strategies) > 1:
        raise ConversionError("compressed-tensors targets with per-tensor and per-channel scales in one "
                              "checkpoint: choose one strategy")
    strategy = next(iter(strategies), None)
    dtype = _parse_dtype(dtype)
    use = _parse_usages(usages)
    # a plain checkpoint in one dtype: what is kept but quantized is dequantized to the recipe's dtype
    keep_dtype = target(recipe).dtype if recipe is not None and target(recipe).family == "plain" else dtype
    plans: list[TensorPlan] = []
    by_name: dict[str, TensorPlan] = {}
    for name, st in source.tensors.items():
        value, explicit = r.lookup(name, st.shape)
        src_file = _file_of(source, st)
        step = _plan_step(st, value, explicit, family, keep_dtype if value == KEEP else dtype, use, strategy,
                          src_file)
        plan = TensorPlan(name, st, step, _fmt(step.out_q, step.out_dtype, family),
                          _layout(family, name, st.shape, step, strategy))
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
    return family, strategy, plans


# --- output ---------------------------------------------------------------------------------------

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
        self.single = dst.suffix == ".safetensors"
        self.root = dst.parent if self.single else dst
        self.old = self._existing()
        self.root.mkdir(parents=True, exist_ok=True)
        self.writer: CheckpointWriter | None = None
        self.files: ShardSet | None = None
        if family == "te":
            protos = {p.name: p.step.proto(p.src.shape) for p in plans if p.alias_of is None}
            protos = {p.name: protos[p.alias_of or p.name] for p in plans}
            aliases = {p.name: p.alias_of for p in plans if p.alias_of is not None}
            tree = source.tree if source.layout == "te-serial" else None
            self.writer = CheckpointWriter(dst, protos, aliases=aliases, tree=tree, max_shard_size=limit,
                                           metadata=metadata)
        else:
            self.files = ShardSet(self.root, [k for p in plans for k in p.keys], limit=limit,
                                  single=dst if self.single else None, metadata={"format": "pt"},
                                  shard_name=_hf_shard_name)

    def write(self, plan: TensorPlan, out: torch.Tensor) -> None:
        if self.writer is not None:
            self.writer.write(plan.name, out)
            return
        blobs = _export(self.family, plan.name, out)
        if set(blobs) != {k for k, _, _ in plan.keys}:
            raise ConversionError(f"output buffers {sorted(blobs)} differ from the plan "
                                  f"{sorted(k for k, _, _ in plan.keys)}", tensor=plan.name)
        for key, t in blobs.items():
            self.files.write(key, t)

    def commit(self, config: dict | None, aux: list[Path]) -> list[str]:
        """Commit the weights (manifest or index last), then the model directory's other files."""
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
            for p in aux:
                if p.name != CONFIG_NAME:
                    shutil.copyfile(p, self.root / p.name)
                    written.append(p.name)
            if config is not None:
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
                if p.is_file() and (p.suffix == ".safetensors" or p.name in (MANIFEST_NAME, INDEX_NAME))}

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()
        else:
            self.files.abort()


def _ignored_modules(plans: list[TensorPlan]) -> list[str]:
    """Linear-looking modules left unquantized (2-D ``*.weight`` kept plain), for engine configs."""
    out = []
    for p in plans:
        n = p.name
        if p.step is not None and p.step.out_q is None and len(p.src.shape) == 2 and n.endswith(".weight") \
                and p.src.dtype.is_floating_point and "embed" not in n and "norm" not in n:
            out.append(n[: -len(".weight")])
    return out


def _config(family: str, strategy: str | None, source: Source, plans: list[TensorPlan]) -> dict | None:
    """config.json for the output: the source's, with a quantization_config that matches the weights."""
    base = dict(source.config) if isinstance(source.config, dict) else None
    if family in ("te", "plain"):
        if base is None:
            return None
        base.pop("quantization_config", None)
        return base
    ignored = _ignored_modules(plans)
    if family == "deepseek":
        qc: dict[str, Any] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                              "weight_block_size": [128, 128]}
        if ignored:
            qc["ignored_layers"] = ignored
            qc["modules_to_not_convert"] = ignored
    else:
        args = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": None, "num_bits": 8,
                "observer": "minmax", "observer_kwargs": {}, "strategy": strategy, "symmetric": True,
                "type": "float"}
        act = {"actorder": None, "block_structure": None, "dynamic": True, "group_size": None, "num_bits": 8,
               "observer": None, "observer_kwargs": {}, "strategy": "token", "symmetric": True, "type": "float"}
        qc = {"config_groups": {"group_0": {"input_activations": act, "output_activations": None,
                                            "targets": ["Linear"], "weights": args}},
              "format": "float-quantized", "ignore": ignored, "kv_cache_scheme": None,
              "quant_method": "compressed-tensors", "quantization_status": "compressed"}
    base = base or {}
    base["quantization_config"] = qc
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
            usages: str | None = None, overwrite: bool = False) -> ConversionReport:
    """Convert the checkpoint at ``src`` into ``dst``, streaming, and report what happened per tensor.

    ``src``: any layout te-serial reads, auto-detected — te-serial (any recipe), plain
    safetensors (one file, or shards with ``model.safetensors.index.json``), DeepSeek-V3 block
    FP8, compressed-tensors FP8 (per-tensor or per-channel); anything else raises
    :class:`~te_serial.UnknownLayoutError`.

    ``recipe``: the target of the default rule — a te-serial recipe (``mxfp8``, ``nvfp4_2d``, …,
    see :data:`te_serial.recipes.RECIPES`), ``bf16``/``fp16``/``fp32`` (a plain Hugging Face
    safetensors checkpoint), ``deepseek_fp8``, ``compressed_tensors_fp8`` (per-channel) or
    ``compressed_tensors_fp8_tensor`` (both with the ``config.json`` ``quantization_config``
    engines expect). ``None`` with no rules keeps every tensor (a layout conversion, e.g.
    DeepSeek → te-serial).

    ``rules``: ``{glob pattern on tensor names: target or "keep"}`` (first match wins, unmatched
    tensors are kept), or a rules file. Default: 2-D ``*.weight`` tensors get ``recipe`` except
    embeddings, ``lm_head``, norms and MoE routers; everything else is kept.

    ``dtype``: nominal dtype of newly quantized tensors and dtype of dequantized ones.
    ``usages``: ``"rowwise"``, ``"columnwise"`` or ``"both"`` for te-serial recipe targets
    (default: the source tensor's usages if it is quantized, else both).
    ``dst``: a directory (te-serial shards + ``te_serial.msgpack``, or HF shards + index +
    ``config.json``), or a ``.safetensors`` file (te-serial or plain targets).
    ``report``: also save the report as JSON there. ``progress(done_bytes, total_bytes, name)``
    is called after each tensor.
    """
    t0 = time.perf_counter()
    src_path, dst_path = Path(src), Path(dst)
    limit = parse_size(max_shard_size)
    out_dtype = _parse_dtype(dtype)
    with open_source(src_path, dtype=out_dtype) as source:
        family, strategy, plans = plan_conversion(source, recipe=recipe, rules=rules, dtype=out_dtype,
                                                  usages=usages)
        single = dst_path.suffix == ".safetensors"
        if single and family in ("deepseek", "ct"):
            raise ConversionError(f"{FAMILY_LAYOUT[family]} is a model directory (config.json + safetensors); "
                                  "give a directory as destination", file=str(dst_path))
        _check_destination(src_path, dst_path, overwrite, single)
        rep = ConversionReport(str(src_path), str(dst_path), source.layout, FAMILY_LAYOUT[family], recipe)
        metadata = dict(source.metadata) if family == "te" else {}
        if family == "te":
            metadata["te_serial.converted_from"] = source.layout
        out = _Output(dst_path, family, plans, limit, source, metadata)
        total = source.nbytes
        done = 0
        reports: dict[str, TensorReport] = {}
        protos: dict[str, TensorProto] = {}
        if progress is not None:
            progress(0, total, "")
        try:
            for plan in plans:
                st = plan.src
                if plan.alias_of is not None:
                    ref = reports[plan.alias_of] if plan.alias_of in reports else None
                    reports[plan.name] = TensorReport(plan.name, st.shape, _src_fmt(st), plan.target, "tied",
                                                      ref.label if ref else LOSSLESS,
                                                      ref.max_abs_err if ref else 0.0, ref.rel_rmse if ref else 0.0,
                                                      ref.snr_db if ref else math.inf, 0, 0,
                                                      f"tied to {plan.alias_of}")
                    continue
                try:
                    reports[plan.name], protos[plan.name] = _convert_one(source, plan, out, family)
                except CheckpointError:
                    raise  # the reader's own error (file, tensor, field), whatever reads it
                except TeSerialError as e:
                    raise ConversionError(str(e), file=_file_of(source, st), tensor=plan.name) from e
                except (RuntimeError, ValueError, TypeError, OSError, MemoryError) as e:
                    raise ConversionError(f"{type(e).__name__}: {e}", file=_file_of(source, st),
                                          tensor=plan.name) from e
                if st.alias_of is None:
                    done += st.nbytes
                if progress is not None:
                    progress(done, total, plan.name)
            for name, (reason, nbytes) in source.dropped.items():
                reports[name] = TensorReport(name, source.file(source._where[name]).entries[name].shape,
                                             "activation scale", "-", "drop", DROPPED, src_bytes=nbytes, note=reason)
            config = _config(family, strategy, source, plans)
            aux = source.aux_files if source.path.is_dir() else []
            if config is not None and single:
                config = None  # a single file has nowhere to put it
            rep.files = out.commit(config, [] if single else aux)
        except BaseException:
            out.abort()
            raise
        rep.tensors = [reports[p.name] for p in plans] + [reports[n] for n in source.dropped]
        if source.tree is not None and family != "te":
            rep.notes.append("the te-serial checkpoint's non-tensor values (its tree) are not kept in safetensors")
        if family in ("deepseek", "ct") and source.config is None:
            rep.notes.append("the source has no config.json: the written config.json holds only quantization_config")
    rep.seconds = time.perf_counter() - t0
    if report is not None:
        rep.save(report)
    return rep


def _convert_one(source: Source, plan: TensorPlan, out: _Output, family: str) -> tuple[TensorReport, TensorProto]:
    st, step = plan.src, plan.step
    src = source.load(plan.name)
    cache: dict[str, torch.Tensor] = {}

    def x_fn() -> torch.Tensor:
        if "x" not in cache:
            cache["x"] = values(src)
        return cache["x"]

    result, step = execute(step, src, x_fn)
    proto = TensorProto(st.shape, step.out_dtype, step.out_q if isinstance(result, QuantizedTensorStorage) else None)
    out.write(plan, result)
    target_fmt = _fmt(proto.quantizer, step.out_dtype, family)
    quantized_src = isinstance(src, QuantizedTensorStorage)
    primary = x_fn if quantized_src else (lambda: src)  # a plain source is compared as it is (no copy)
    if step.builder == "keep":
        stats = ErrorStats(True)
    elif not isinstance(result, QuantizedTensorStorage):
        stats = compare(primary(), result)
    else:
        # A usage built from the source's bytes is compared with the source's same usage (when it has
        # one); a requantized usage with the values it was quantized from (the source's primary ones).
        requantized = step.builder in ("quantize", "per_channel")
        if not requantized and not step.requant:
            cache.clear()
        stats = None
        for u in enabled(result.quantizer):
            src_has = quantized_src and (src.quantizer.rowwise if u == ROW else src.quantizer.columnwise)
            rebuilt = requantized or u in step.requant
            ref = values(src, u) if src_has and not rebuilt else primary()
            s = compare(ref, values(result, u))
            del ref
            stats = s if stats is None else stats.worst(s)
        stats = stats or ErrorStats(True)
    note = step.note
    if step.exact or step.method in ("cast", "dequantize"):
        label = LOSSLESS if stats.exact else LOSSY
        if step.exact and not stats.exact:
            note = (note + "; " if note else "") + "expected an exact path but the values differ (source " \
                   "buffers are not what their format's layout promises)"
    else:
        label = LOSSY  # a requantized tensor is lossy by its path, whatever this data did
        if stats.exact:
            note = (note + "; " if note else "") + "requantized, and these values came out bit-identical"
    if label == LOSSLESS:
        stats = ErrorStats(True)
    rep = TensorReport(plan.name, st.shape, _src_fmt(st), target_fmt, step.method, label, stats.max_abs_err,
                       stats.rel_rmse, stats.snr_db, st.nbytes, plan.nbytes, note)
    return rep, proto
