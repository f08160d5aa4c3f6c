"""The paper's efficiency numbers (docs/benchmarks.md), to print beside ours."""

from __future__ import annotations

#: Table 4: forward GFLOPs per image, D = 768, 12 block applications, whole model.
TABLE4_TOTAL: dict[str, dict[int, float]] = {
    "mha": {224: 35.1, 384: 111.0, 512: 214.1, 640: 368.3, 768: 590.1},
    "ssog": {224: 28.4, 384: 84.3, 512: 151.1, 640: 237.9, 768: 345.3},
}
#: Table 4: attention alone.
TABLE4_ATTENTION: dict[str, dict[int, float]] = {
    "mha": {224: 12.6, 768: 326.4},
    "ssog": {224: 6.0, 768: 81.7},
}
#: Table 3: operator-alone peak memory (MiB), batch 8, CUDA fp16: SSoG and fused MHA.
TABLE3_MEMORY_MIB: dict[str, dict[int, float]] = {
    "ssog": {224: 47.6, 512: 184.5, 1024: 689.0},
    "mha": {224: 29.2, 512: 88.3, 1024: 304.3},
}


def table4(mixer: str, res: int, *, attention: bool = False) -> float | None:
    """The paper's GFLOPs for a base-width (D = 768, 12 applications) model, or None where it has none."""
    table = TABLE4_ATTENTION if attention else TABLE4_TOTAL
    key = "mha" if mixer.startswith("mha") else "ssog" if mixer == "ssog" else None
    return table.get(key, {}).get(res) if key else None
