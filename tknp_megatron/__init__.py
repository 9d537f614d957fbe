"""tknp-megatron: Decode Token Parallelism (TKNP) for NVIDIA Megatron-Core."""

__version__ = "0.1.0"
