from setuptools import find_packages, setup

setup(
    name="composite",
    version="0.1.0",
    description="Split LLaMA into ExecuTorch shards across Qualcomm QNN HTP and XNNPACK, and run the chain",
    packages=find_packages(include=["composite", "composite.*"]),
    package_data={
        "composite.model": ["data/*.txt"],
        "composite.qnn_host": ["htp_abi_shim.c", "qnn_interface_layout.h"],
    },
    python_requires=">=3.10",
    install_requires=[
        # torch is pinned: an unpinned torch pulls a multi-GB CUDA build.
        "torch==2.13.0",
        "executorch==1.5.1",
        "torchao",
        "pytorch-tokenizers",
        "tokenizers",  # tokenizer.json, in composite.run as in transformers
        "sentencepiece",
        "protobuf",  # SentencePiece's model format, written from a GGUF vocabulary
        "gguf",  # ggml-org's reader: GGUF checkpoints
        "jinja2",  # chat templates, rendered as transformers renders them
        "safetensors",
        "pyyaml",
        "tqdm",
        "matplotlib",  # composite.report and composite.bench pictures
        "cmake>=3.28",
        "pyelftools",  # composite.deploy reads the runner's shared-library closure
        # ruamel.yaml's C loader: importing ExecuTorch's exir parses its edge-op YAML, 2.8 s of CPU less
        # per process with it (13.1 -> 10.3 s, 2-core AMD EPYC, 2026-12-04); every CLI imports exir.
        "ruamel.yaml.clib",
    ],
    # transformers reads GGUF files with gguf and accelerate: the tests' reference for them.
    # pytest-xdist: scripts/test.sh runs the tests in two processes, one per core.
    # cluster: Ray, the distributed engine of --ray (composite/executor/ray_cluster.py); the tests start
    # a local Ray cluster of their own.
    extras_require={
        "cluster": ["ray==2.60.0"],
        "test": ["pytest", "pytest-xdist", "transformers", "accelerate", "ruff==0.17.6", "ray==2.60.0"],
    },
)
