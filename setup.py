"""Install omnitron; build the optional C++ extensions from csrc/ when a compiler exists.

``omnitron._C`` (csrc/cpu): fused CPU kernels. ``omnitron._sim`` (csrc/sim): the simulated accelerator
``sim`` (a PrivateUse1 device over host memory, loaded only by the sim backend). The package works
without either: every fused op has a plain-PyTorch reference, and the sim backend reports itself
unavailable with the command that builds it.
"""
import glob
import os
import shutil

from setuptools import find_packages, setup

VERSION = "0.1.0"


def _extensions():
    if os.environ.get("OMNITRON_NO_EXT") == "1" or shutil.which(os.environ.get("CXX", "c++")) is None:
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:  # torch not installed yet: pure-Python install
        return [], {}
    if not os.path.exists("csrc/bindings.cpp"):
        return [], {}
    sources = [str(path) for path in _kernel_sources().compiled_sources("csrc")]  # the JIT build's list
    # NOTE: -march=native by default: the extension is built on the machine that runs it (pip install -e),
    # and the kernels are auto-vectorised loops: built for baseline x86-64, 17 of 21 op/dtype/mode rows of
    # `omnitron bench kernels` ran over 2x slower side by side (1-31x: swiglu 11-17x, cross-entropy 8-31x).
    # The tests do not depend on it (parity runs on the references in float64; the kernels' conformance
    # bounds hold on any CPU). OMNITRON_MARCH=x86-64-v3 (or another -march value) builds for other machines.
    march = os.environ.get("OMNITRON_MARCH", "native")
    std = _cxx_std()
    ext = CppExtension(
        "omnitron._C",
        sources,
        extra_compile_args=["-O3", "-g0", "-fopenmp", f"-march={march}", "-fno-math-errno", std,
                            _kernel_sources().digest_define("csrc")],
        extra_link_args=["-fopenmp"],
    )
    # The simulated device: no -march (nothing here is a hot loop), no OpenMP.
    sim = CppExtension("omnitron._sim", sorted(glob.glob("csrc/sim/*.cpp")),
                       extra_compile_args=["-O3", "-g0", std])
    return [ext, sim], {"build_ext": _parallel(BuildExtension.with_options(use_ninja=False))}


def _kernel_sources():
    """``omnitron/kernels/sources.py``, loaded by path: the sources' digest and the C++ standard, shared with the
    JIT build (importing the omnitron package here would import what is being built)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_omnitron_kernel_sources", "omnitron/kernels/sources.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cxx_std() -> str:
    """The C++ standard of the installed torch's headers (``sources.cxx_std``)."""
    import torch

    return _kernel_sources().cxx_std(torch.__version__)


def _parallel(build_ext):
    """``build_ext`` building the extensions side by side: ``MAX_JOBS`` (default 2, the CI machine's cores)
    compile jobs, so omnitron._sim's compile overlaps omnitron._C's instead of adding to it."""

    class Parallel(build_ext):
        def finalize_options(self):
            super().finalize_options()
            if not self.parallel:
                self.parallel = int(os.environ.get("MAX_JOBS", "2"))

    return Parallel


ext_modules, cmdclass = _extensions()

setup(
    name="omnitron",
    version=VERSION,
    description="3D-parallel FP8 Transformer training on any full-function GPU (CUDA, MUSA) or CPU",
    packages=find_packages(include=["omnitron", "omnitron.*"]),
    package_data={"omnitron": ["data/*", "data/**/*", "backends/musa/*.txt", "backends/musa/torch_musa_api/*.txt",
                               "plan/devices/*.toml", "core/training/megatron_flags.txt"]},
    include_package_data=True,
    python_requires=">=3.10",
    install_requires=[
        # The tested range (omnitron/backends/torch_range.py TESTED; scripts/torch_matrix.sh runs it): 2.9 is
        # the oldest torch a current vendor stack ships (torch_musa v2.9.x), 2.15 the newest on PyPI (2026-12-06).
        "torch>=2.9,<2.16",
        "numpy",
        "pyyaml",
        "tokenizers>=0.15",
        "safetensors",
        "tqdm",
        "packaging",  # a backend plug-in's recorded requirements on omnitron and torch (backends/registry.py)
    ],
    # Triton: each torch pins its own (2.9: 3.5.1, 2.10/2.11: 3.6.0, 2.12: 3.7.0, 2.13: 3.7.1); the floor is
    # the oldest torch's pin, so an extra never asks for a Triton the installed torch does not pin.
    extras_require={
        "triton": ["triton>=3.5.1"],
        "tiktoken": ["tiktoken"],  # --tokenizer-type TikTokenizer
        "dev": ["pytest", "pytest-xdist", "regex", "pybind11", "triton>=3.5.1", "sentencepiece", "matplotlib",
                "transformers>=4.45",
                "tensorboard", "tiktoken"],
        "tensorboard": ["tensorboard"],
        "wandb": ["wandb"],
    },
    entry_points={"console_scripts": ["omnitron=omnitron.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
