"""Command-line tools, each run as ``python -m tknp_megatron.tools.<name>``."""
