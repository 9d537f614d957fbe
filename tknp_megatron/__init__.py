"""tknp-megatron: Decode Token Parallelism (TKNP) for NVIDIA Megatron-Core."""

from tknp_megatron.cpu_import import install as _install_cpu_import

__version__ = "0.1.0"

_install_cpu_import()  # before anything here imports Megatron-Core (see cpu_import)
