"""CUDA backend logic that needs no GPU: capability facts per architecture, peak table, probe reason."""
from __future__ import annotations

import pytest
import torch

from omnitron.backends.cuda.backend import CUDABackend, cuda_capabilities
from omnitron.backends.cuda.peaks import peak_flops


def test_hopper_has_fp8_and_the_datasheet_peaks():
    caps = cuda_capabilities("NVIDIA H200", (9, 0), 141 * 2**30, True, scaled_mm=True)
    assert caps.arch == "sm_90" and caps.fp8_formats == ("e4m3", "e5m2") and caps.fp8_gemm == "scaled_mm"
    assert caps.peak("bf16") == 989e12 and caps.peak("fp8") == 1979e12
    assert caps.flash_attention and torch.bfloat16 in caps.dtypes
    h100 = cuda_capabilities("NVIDIA H100 80GB HBM3", (9, 0), None, True, scaled_mm=True)
    assert h100.fp8_gemm == "scaled_mm" and h100.peak(torch.bfloat16) == 989e12
    broken = cuda_capabilities("NVIDIA H100 80GB HBM3", (9, 0), None, True, scaled_mm=False)  # the probe GEMM failed
    assert broken.fp8_gemm is None and not broken.fp8_recipes


def test_ampere_and_older_claim_no_fp8():
    a100 = cuda_capabilities("NVIDIA A100-SXM4-80GB", (8, 0), None, True, scaled_mm=True)
    assert a100.arch == "sm_80" and not a100.fp8_formats and a100.fp8_gemm is None and not a100.fp8_recipes
    assert a100.peak("bf16") == 312e12 and a100.peak("fp8") is None
    t4 = cuda_capabilities("Tesla T4", (7, 5), None, False, scaled_mm=True)
    assert torch.bfloat16 not in t4.dtypes and not t4.flash_attention and t4.peak("bf16") is None
    ada = cuda_capabilities("NVIDIA L4", (8, 9), None, True, scaled_mm=True)
    assert ada.fp8_gemm == "scaled_mm" and ada.peak("fp8") == 242e12


@pytest.mark.parametrize("name, bf16", [("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12),
                                        ("NVIDIA L40S", 362e12), ("NVIDIA L4", 121e12),
                                        ("NVIDIA A100-PCIE-40GB", 312e12), ("NVIDIA GeForce RTX 3090", None)])
def test_peak_table_matches_specific_names_first(name, bf16):
    assert peak_flops(name)["bf16"] == bf16


@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch has CUDA")
def test_probe_names_the_missing_piece():
    ok, why = CUDABackend.probe()
    assert not ok and "this torch build has no CUDA" in why


def test_backend_calls_only_existing_torch_cuda_names():
    """Without a GPU the CUDA backend's calls cannot run here; at least every ``torch.cuda.X`` (and
    ``torch.version`` / ``torch.backends.cudnn``) name it spells must exist in this torch."""
    import pathlib
    import re

    import omnitron.backends.cuda.backend as cuda_backend

    src = pathlib.Path(cuda_backend.__file__).read_text()
    names = set(re.findall(r"\btorch\.(?:cuda|backends\.cudnn)(?:\.[A-Za-z_]\w*)+", src))
    assert "torch.cuda.max_memory_allocated" in names  # the grep works
    for name in sorted(names):
        obj = torch
        for part in name.split(".")[1:]:
            assert hasattr(obj, part), f"{name}: this torch has no {part!r}"
            obj = getattr(obj, part)


def test_strict_p2p_posts_one_group_per_batch_on_nccl():
    """NCCL runs a communicator's p2p groups in order, each until all its operations ran: strict mode must post each
    batch as one group there (the shape checked under NCCL's rule in tests/backends/test_strict_nccl_groups.py)."""
    assert CUDABackend().collectives.p2p_groups_in_order


@pytest.mark.parametrize("name, profile", [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100-sxm"),
                                           ("NVIDIA A100-SXM4-80GB", "a100-80gb-sxm"), ("NVIDIA B200", "b200")])
def test_peak_table_agrees_with_the_device_profiles(name, profile):
    """The peaks MFU and ``omnitron bench gemm``'s % of peak divide by are the planner's profiles' (each citing
    its datasheet), TF32 included (the bench's tf32 row had no peak on any GPU). The table rounds to 3-4
    significant figures (989 for 989.4): within 0.1%. The profile's B200 FP32 is marked uncertain there and
    the table leaves it out."""
    from omnitron.plan.profile import load

    table, prof = peak_flops(name), load(profile)
    assert table["tf32"] is not None
    for dtype, value in table.items():
        if value is not None:
            assert value == pytest.approx(prof.peak_of(dtype), rel=1e-3), (name, dtype)
