"""What this CPU can run fast: one probe of its features, read once, that decides each dtype's kernels.

The flags come from the kernel (`/proc/cpuinfo` on Linux, the names Linux gives them), and are then capped as
oneDNN is: `ONEDNN_MAX_CPU_ISA=AVX2` makes oneDNN (and torch's checks, which ask oneDNN) behave as on an AVX2-only
CPU, so the probe must say the same or bouquet would pick a path oneDNN then refuses. `$BOUQUET_CPU_FEATURES`
(comma-separated flags) replaces the probe outright, for tests and for forcing a path; with
`ATEN_CPU_CAPABILITY=avx2` beside them, an AVX-512 machine runs the code paths of an AVX2 one (not its speed).
No torch here: the config resolves `--dtype auto` with it.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

FEATURES_ENV = "BOUQUET_CPU_FEATURES"
ONEDNN_ISA_ENV = "ONEDNN_MAX_CPU_ISA"

AVX2 = ("avx2", "fma")
AVX512 = ("avx512f", "avx512bw", "avx512vl", "avx512dq")
# oneDNN's ISA levels in increasing order and the flags each one adds (its `cpu_isa_t`, by Linux flag names).
_ONEDNN_LEVELS: tuple[tuple[tuple[str, ...], tuple[str, ...]], ...] = (
    (("SSE41",), ("sse4_1",)),
    (("AVX",), ("avx",)),
    (("AVX2",), ("avx2", "fma", "f16c", "bmi1", "bmi2")),
    (("AVX2_VNNI",), ("avx_vnni",)),
    (("AVX2_VNNI_2",), ("avx_ne_convert", "avx_vnni_int8")),
    (("AVX512_CORE",), ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd")),
    (("AVX512_CORE_VNNI",), ("avx512_vnni",)),
    (("AVX512_CORE_BF16",), ("avx512_bf16",)),
    (("AVX512_CORE_FP16", "AVX10_1_512"), ("avx512_fp16",)),
    (("AVX512_CORE_AMX", "AVX10_1_512_AMX"), ("amx_tile", "amx_int8", "amx_bf16")),
    (("AVX512_CORE_AMX_FP16", "AVX10_1_512_AMX_FP16"), ("amx_fp16",)),
)
# Flags that no oneDNN level grants: what a cap removes when they are not in the levels it allows.
_CAPPED = frozenset(flag for _, flags in _ONEDNN_LEVELS for flag in flags)


@dataclass(frozen=True)
class CpuFeatures:
    """The CPU's feature flags (Linux's names) and what they allow."""

    flags: frozenset[str]
    model_name: str = "unknown CPU"
    source: str = "/proc/cpuinfo"

    def has(self, *names: str) -> bool:
        return all(name in self.flags for name in names)

    def missing(self, *names: str) -> list[str]:
        return [name for name in names if name not in self.flags]

    @property
    def isa(self) -> str:
        """The widest vector code bouquet's own kernels may run: "avx512", "avx2" or "baseline"."""
        if self.has(*AVX2, *AVX512):
            return "avx512"
        return "avx2" if self.has(*AVX2) else "baseline"

    @property
    def vnni(self) -> bool:
        return self.has("avx512_vnni") or self.has("avx_vnni")

    @property
    def amx(self) -> bool:
        return self.has("amx_tile", "amx_bf16")

    @property
    def packed_bf16(self) -> bool:
        """Whether oneDNN reorders and runs bfloat16 weights (torch's check: AVX-512 BW/VL/DQ, or AVX-NE-CONVERT)."""
        return self.has(*AVX512) or self.has("avx_ne_convert")

    @property
    def fast_bf16(self) -> bool:
        """Whether bfloat16 matrix products are native (AVX512-BF16 dot products, or AMX tiles), so faster than
        float32; elsewhere bfloat16 is converted to float32 for every product and is slower than float32."""
        return self.packed_bf16 and (self.has("avx512_bf16") or self.amx)

    def describe(self) -> str:
        shown = [*AVX2, *AVX512, "avx512_vnni", "avx_vnni", "avx512_bf16", "avx_ne_convert", "amx_bf16", "amx_int8"]
        present = [name for name in shown if name in self.flags] or ["no AVX2"]
        return f"{self.model_name} ({', '.join(present)}; from {self.source})"


@functools.cache
def cpu_features() -> CpuFeatures:
    """The probe, once per process: `$BOUQUET_CPU_FEATURES` if set, else the kernel's flags, capped at
    `$ONEDNN_MAX_CPU_ISA`."""
    model_name = _model_name()
    override = os.environ.get(FEATURES_ENV)
    if override is not None:
        flags = frozenset(flag.strip().lower() for flag in override.split(",") if flag.strip())
        return CpuFeatures(flags, model_name, f"${FEATURES_ENV}")
    features = CpuFeatures(_kernel_flags(), model_name)
    cap = os.environ.get(ONEDNN_ISA_ENV)
    return cap_at_onednn_isa(features, cap) if cap else features


def cap_at_onednn_isa(features: CpuFeatures, level: str) -> CpuFeatures:
    """The features oneDNN uses under `ONEDNN_MAX_CPU_ISA=level` (ALL, or an unknown name, caps nothing)."""
    allowed: set[str] = set()
    for names, flags in _ONEDNN_LEVELS:
        allowed.update(flags)
        if level.upper() in names:
            removed = _CAPPED - allowed
            return CpuFeatures(
                features.flags - removed, features.model_name, f"{features.source}, ${ONEDNN_ISA_ENV}={level}"
            )
    return features


def _kernel_flags() -> frozenset[str]:
    for line in _cpuinfo_lines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def _model_name() -> str:
    for line in _cpuinfo_lines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return platform.processor() or platform.machine() or "unknown CPU"


@functools.cache
def _cpuinfo_lines() -> tuple[str, ...]:
    try:
        return tuple(Path("/proc/cpuinfo").read_text().splitlines())
    except OSError:  # not Linux: no flags, so every choice takes its portable path
        return ()
