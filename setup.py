"""hpctrain: MPI-native training of large models on supercomputers."""
from setuptools import find_packages, setup

setup(
    name="hpctrain",
    version="0.1.0",
    description="MPI-native data/tensor/pipeline-parallel training with HDF5 checkpoints and Slurm lifecycle",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",  # tomllib
    packages=find_packages(include=["hpctrain", "hpctrain.*"]),
    # files the package runs besides its modules: the sweep's sbatch template, the two-hosts test network
    package_data={"hpctrain.tools": ["two_hosts.sh"], "hpctrain.sweep": ["scaling_study.sbatch"]},
    install_requires=[
        "numpy",
        # a range, so `pip install -e .` on a cluster keeps the site's torch (module, ROCm or CUDA build);
        # 2.11 (GPU machine) and 2.13 (CPU) are tested. Laptops and CI pin the CPU build through
        # scripts/constraints.txt (scripts/setup.sh): an unconstrained torch resolves to a multi-GB CUDA build.
        "torch>=2.11",
        "mpi4py>=4.1",
        "h5py",
        "rich",
        "matplotlib",
    ],
    extras_require={
        "mpi": ["mpich"],  # PyPI MPICH wheel: laptops and CI; clusters bring their own MPI
        "gpu": ["cupy"],  # pick the cupy-cudaXXx wheel that matches your CUDA instead where needed
        # transformers and peft only in tests (logits compared with LlamaForCausalLM, LoRA with PEFT)
        # mypy pinned: tests/unit/test_type_check.py wants zero findings, and a new mypy finds new ones
        # coverage pinned: tests/unit/test_cuda_coverage.py measures the lines the CPU tests run of CUDA-only modules
        "test": ["pytest", "pytest-timeout", "pytest-xdist", "transformers", "safetensors", "peft", "mypy==2.4.1", "coverage==7.17.3"],
        "compression": ["zfpy"],  # compression.method = "zfp" (a manylinux wheel)
        "data": ["tokenizers"],  # data.tokenizer = a tokenizer.json; hpctrain data train-tokenizer
        "hf": ["safetensors"],
        # model.head_kernel = liger / cce (or auto's trial of them): fused head + loss kernels at tp = 1, CUDA
        # only (Triton); without them hpctrain's own runs (hpctrain/parallel/head_kernels.py)
        "kernels": ["liger-kernel", "cut-cross-entropy"],
        "fp8": ["torchao==0.18.0"],  # train.fp8: torchao.float8's casts (hpctrain/parallel/fp8.py TORCHAO_VERSION)
        "monitor": ["prometheus-client", "tensorboard"],  # [monitor]: Prometheus metrics, TensorBoard event files  # hpctrain export --format hf, hpctrain import-hf, model.init_from = an HF directory
    },
    entry_points={"console_scripts": ["hpctrain=hpctrain.cli:main"]},
)
