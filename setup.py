"""Build of osp and its extension osp._C.

The CPU kernels are always built. The CUDA kernels are built when the installed torch has CUDA and
nvcc is found, or when FORCE_CUDA=1 (which fails loudly if it cannot). FORCE_ONLY_CPU=1 skips them.
"""
import glob
import os
import shutil

from setuptools import find_packages, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension, CUDA_HOME
import torch

ROOT = os.path.dirname(os.path.abspath(__file__))


def want_cuda():
    if os.environ.get("FORCE_ONLY_CPU", "0") == "1":
        return False
    if os.environ.get("FORCE_CUDA", "0") == "1":
        if CUDA_HOME is None and shutil.which("nvcc") is None:
            raise RuntimeError("FORCE_CUDA=1 but no CUDA toolkit (nvcc / CUDA_HOME) was found")
        return True
    return torch.version.cuda is not None and CUDA_HOME is not None


def extension():
    cxx = ["-O3", "-std=c++17", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"]
    sources = ["csrc/bindings.cpp"] + sorted(glob.glob("csrc/cpu/*.cpp"))
    if want_cuda():
        nvcc = ["-O3", "-std=c++17", "-lineinfo"]
        return CUDAExtension(
            "osp._C",
            sources + sorted(glob.glob("csrc/cuda/*.cpp")) + sorted(glob.glob("csrc/cuda/*.cu")),
            extra_compile_args={"cxx": cxx, "nvcc": nvcc},
            extra_link_args=["-fopenmp"],
        )
    # at::parallel_for is inline OpenMP: without -fopenmp here it would run on one thread.
    return CppExtension("osp._C", sources, extra_compile_args={"cxx": cxx}, extra_link_args=["-fopenmp"])


setup(
    name="osp",
    version="0.1.0",
    description="Two-stage synchronization (OSP) and friends for data-parallel PyTorch training",
    package_dir={"": "python"},
    packages=find_packages("python"),
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    python_requires=">=3.9",
    install_requires=["torch>=2.1", "numpy"],
    extras_require={"horovod": ["horovod>=0.28"], "train": ["scikit-learn"], "lightning": ["pytorch-lightning>=2.1"]},
)
