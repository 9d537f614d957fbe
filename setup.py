"""tknp-megatron: Decode Token Parallelism (TKNP) for NVIDIA Megatron-Core."""

from setuptools import find_packages, setup

SERVE = ["pyzmq", "msgpack", "flask[async]", "quart", "hypercorn"]

setup(
    name="tknp-megatron",
    version="0.1.0",
    description="Decode Token Parallelism (TKNP) for LLM decode serving on Megatron-Core",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["tknp_megatron", "tknp_megatron.*", "parallel_state"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.4",
        "megatron-core>=0.16,<0.20",
        "numpy",
        "packaging",
    ],
    entry_points={
        "console_scripts": [
            "tknp-bench-attention = tknp_megatron.tools.bench_attention:cli",
            "tknp-bench-dense = tknp_megatron.tools.bench_dense:main",
            "tknp-bench-host = tknp_megatron.tools.bench_host:main",
            "tknp-bench-megatron-engine = tknp_megatron.tools.bench_megatron_engine:cli",
            "tknp-bench-serving = tknp_megatron.tools.bench_serving:main",
            "tknp-bench-step = tknp_megatron.tools.bench_step:main",
            "tknp-bench-vllm = tknp_megatron.tools.bench_vllm:cli",
            "tknp-capacity-report = tknp_megatron.tools.capacity_report:main",
            "tknp-convert-hf = tknp_megatron.tools.convert_hf_checkpoint:main",
            "tknp-traffic-report = tknp_megatron.tools.traffic_report:main",
        ],
    },
    extras_require={
        # Megatron-Core's inference server needs these but does not declare them: ZMQ and
        # msgpack for its coordinator, Flask (megatron-core 0.16) or Quart (0.17 and later)
        # with hypercorn for its HTTP front end.
        "serve": SERVE,
        "test": ["pytest>=8", "pytest-timeout", "pytest-xdist>=3.6", "filelock", "triton", "psutil", "matplotlib>=3.6",
                 "transformers", "safetensors", "gguf", "accelerate", "openai", "requests", "aiohttp"] + SERVE,
        "gpu": ["triton"],
        "te": ["transformer-engine[pytorch]"],
        "flash": ["flash-attn"],
    },
)
