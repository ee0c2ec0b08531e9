"""Install omnitron; build the optional C++ extension omnitron._C from csrc/ when a compiler exists.

The package works without the extension: every fused op has a plain-PyTorch reference.
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
    sources = sorted(glob.glob("csrc/cpu/*.cpp")) + ["csrc/bindings.cpp"]
    if not os.path.exists("csrc/bindings.cpp"):
        return [], {}
    ext = CppExtension(
        "omnitron._C",
        sources,
        extra_compile_args=["-O3", "-g0", "-fopenmp", "-march=native", "-fno-math-errno", "-std=c++17"],
        extra_link_args=["-fopenmp"],
    )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=False)}


ext_modules, cmdclass = _extensions()

setup(
    name="omnitron",
    version=VERSION,
    description="3D-parallel FP8 Transformer training on any full-function GPU (CUDA, MUSA) or CPU",
    packages=find_packages(include=["omnitron", "omnitron.*"]),
    package_data={"omnitron": ["data/*", "data/**/*", "backends/musa/*.txt"]},
    include_package_data=True,
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4,<2.14",
        "numpy",
        "pyyaml",
        "tokenizers>=0.15",
        "safetensors",
        "tqdm",
    ],
    extras_require={
        "triton": ["triton>=3.7.1"],
        "dev": ["pytest", "regex", "pybind11", "triton>=3.7.1", "sentencepiece", "matplotlib", "transformers>=4.45"],
    },
    entry_points={"console_scripts": ["omnitron=omnitron.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
