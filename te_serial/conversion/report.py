"""The conversion report: per tensor, which path it took, lossless or lossy, and the error figures.

Printable as a table (``str(report)``), savable as JSON (``report.save(path)``; strict JSON:
infinite figures are written as the strings ``"inf"`` / ``"-inf"``), and readable back
(:meth:`ConversionReport.load`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

LOSSLESS, LOSSY, DROPPED = "lossless", "lossy", "dropped"
#: the element codes and block scales are the source's bytes, but the layout's reader applies the
#: tensor-wide scale with its own formula: some values land a few fp32 ulp away (``ulp_max``)
EXACT_CODES = "exact codes"


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


def _num(x: float) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


def _unnum(x: Any) -> float:
    if isinstance(x, str):
        return float(x)
    return float(x)


@dataclasses.dataclass
class TensorReport:
    """One tensor's conversion. Error figures compare the output's values (every usage it holds)
    with the source's, in fp32: max |error|, RMSE relative to the source's RMS, and SNR in dB."""

    name: str
    shape: tuple[int, ...]
    source: str          # the source format ("bf16", "mxfp8", "deepseek_fp8", …)
    target: str          # the output format
    method: str          # keep | copy | relayout | quantize | requantize | dequantize | cast | tied | drop
    label: str           # lossless | exact codes | lossy | dropped
    max_abs_err: float = 0.0
    rel_rmse: float = 0.0
    snr_db: float = math.inf
    src_bytes: int = 0
    dst_bytes: int = 0
    note: str = ""
    #: "exact codes" only: the largest distance, in fp32 ulp, between the layout reader's value and
    #: te-serial's, and how many elements may be that far (those in blocks whose per-block factor
    #: differs between the two formulas; zeros among them are equal)
    ulp_max: int = 0
    ulp_elements: int = 0
    #: over which elements the error figures were measured: "full", "sample" (evenly spread row
    #: blocks) or "none" (not measured: the figures are NaN). Exact paths are always "full".
    stats: str = "full"
    #: consumer routes that read this tensor with rounded scales → the largest change of a value
    #: there (the label is what the files hold; these readers get other values)
    routes: dict[str, float] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["shape"] = list(self.shape)
        for k in ("max_abs_err", "rel_rmse", "snr_db"):
            d[k] = _num(d[k])
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "TensorReport":
        d = dict(d)
        d["shape"] = tuple(d["shape"])
        for k in ("max_abs_err", "rel_rmse", "snr_db"):
            d[k] = _unnum(d[k])
        d.setdefault("ulp_max", 0)
        d.setdefault("ulp_elements", 0)
        d.setdefault("stats", "full")
        d.setdefault("routes", {})
        return TensorReport(**d)


@dataclasses.dataclass
class ConversionReport:
    """What :func:`te_serial.convert` did, tensor by tensor."""

    src: str
    dst: str
    source_layout: str
    target_layout: str
    recipe: str | None
    tensors: list[TensorReport] = dataclasses.field(default_factory=list)
    files: list[str] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    notes: list[str] = dataclasses.field(default_factory=list)
    stats: str = "full"          # how requantized tensors' error figures were measured
    device: str = "cpu"          # where the tensors were converted

    # --- summaries ------------------------------------------------------------------------------
    @property
    def src_bytes(self) -> int:
        return sum(t.src_bytes for t in self.tensors)

    @property
    def dst_bytes(self) -> int:
        return sum(t.dst_bytes for t in self.tensors)

    @property
    def lossless(self) -> bool:
        """True when no tensor was changed in value (and none was dropped)."""
        return all(t.label == LOSSLESS for t in self.tensors)

    @property
    def lossy(self) -> list[TensorReport]:
        return [t for t in self.tensors if t.label == LOSSY]

    @property
    def exact_codes(self) -> list[TensorReport]:
        return [t for t in self.tensors if t.label == EXACT_CODES]

    @property
    def dropped(self) -> list[TensorReport]:
        return [t for t in self.tensors if t.label == DROPPED]

    def __getitem__(self, name: str) -> TensorReport:
        for t in self.tensors:
            if t.name == name:
                return t
        raise KeyError(name)

    def counts(self) -> dict[str, int]:
        out = {LOSSLESS: 0, EXACT_CODES: 0, LOSSY: 0, DROPPED: 0}
        for t in self.tensors:
            out[t.label] = out.get(t.label, 0) + 1
        return out

    def summary(self) -> str:
        c = self.counts()
        gbps = self.src_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0
        worst = min((t.snr_db for t in self.lossy if not math.isnan(t.snr_db)), default=math.inf)
        parts = [f"{len(self.tensors)} tensors: {c[LOSSLESS]} lossless"]
        if c[EXACT_CODES]:
            worst_ulp = max(t.ulp_max for t in self.exact_codes)
            parts.append(f"{c[EXACT_CODES]} exact codes (values within {worst_ulp} ulp)")
        parts.append(f"{c[LOSSY]} lossy")
        if c[DROPPED]:
            parts.append(f"{c[DROPPED]} dropped")
        line = ", ".join(parts)
        line += (f"; {format_bytes(self.src_bytes)} -> {format_bytes(self.dst_bytes)}"
                 f" in {self.seconds:.2f} s ({gbps:.2f} GB/s of source)")
        if self.lossy and self.stats != "none":
            line += f"; worst SNR {worst:.1f} dB" + (" (sampled rows)" if self.stats == "sample" else "")
        elif self.lossy:
            line += "; error figures not measured (stats none)"
        return line

    # --- table ------------------------------------------------------------------------------------
    def table(self, *, max_rows: int | None = None) -> str:
        head = (f"{self.source_layout} {self.src} -> {self.target_layout} {self.dst}"
                + (f" (recipe {self.recipe})" if self.recipe else ""))
        rows = [("tensor", "shape", "source", "target", "method", "result", "max abs err", "rel rmse",
                 "SNR dB", "bytes")]
        shown = self.tensors if max_rows is None else self.tensors[:max_rows]
        for t in shown:
            lossy, codes = t.label == LOSSY, t.label == EXACT_CODES
            zero = t.label == LOSSLESS
            result = f"{t.label} (<={t.ulp_max} ulp)" if codes else t.label
            if lossy and t.stats != "full":
                result += " (sampled)" if t.stats == "sample" else " (not measured)"
            lossy = lossy and t.stats != "none"
            rows.append((t.name, "x".join(map(str, t.shape)) or "scalar", t.source, t.target, t.method, result,
                         f"{t.max_abs_err:.4g}" if lossy or codes else "0" if zero else "-",
                         f"{t.rel_rmse:.4g}" if lossy else "0" if zero else "-",
                         f"{t.snr_db:.1f}" if lossy else "inf" if zero else "-",
                         str(t.dst_bytes)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        right = {1, 6, 7, 8, 9}
        lines = [head]
        for j, r in enumerate(rows):
            lines.append("  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
            if j == 0:
                lines.append("  ".join("-" * w for w in widths))
        if max_rows is not None and len(self.tensors) > max_rows:
            lines.append(f"... {len(self.tensors) - max_rows} more tensors")
        notes = [f"note: {t.name}: {t.note}" for t in self.tensors if t.note]
        lines.extend(notes[:50])
        if len(notes) > 50:
            lines.append(f"... {len(notes) - 50} more notes")
        lines.extend(f"note: {n}" for n in self.notes)
        lines.append(self.summary())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    # --- JSON -------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"src": self.src, "dst": self.dst, "source_layout": self.source_layout,
                "target_layout": self.target_layout, "recipe": self.recipe, "seconds": self.seconds,
                "src_bytes": self.src_bytes, "dst_bytes": self.dst_bytes, "lossless": self.lossless,
                "counts": self.counts(), "files": list(self.files), "notes": list(self.notes),
                "stats": self.stats, "device": self.device,
                "tensors": [t.to_dict() for t in self.tensors]}

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    def save(self, path: str | os.PathLike) -> None:
        p = Path(path)
        tmp = p.with_name(f".{p.name}.tmp")
        tmp.write_text(self.to_json() + "\n", encoding="utf-8")
        os.replace(tmp, p)

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "ConversionReport":
        return ConversionReport(d["src"], d["dst"], d["source_layout"], d["target_layout"], d.get("recipe"),
                                [TensorReport.from_dict(t) for t in d["tensors"]], list(d.get("files", [])),
                                float(d.get("seconds", 0.0)), list(d.get("notes", [])), d.get("stats", "full"),
                                d.get("device", "cpu"))

    @staticmethod
    def load(path: str | os.PathLike) -> "ConversionReport":
        return ConversionReport.from_dict(json.loads(Path(path).read_text(encoding="utf-8")))
