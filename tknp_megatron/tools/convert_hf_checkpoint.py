"""Convert a Hugging Face Llama / Nemotron safetensors folder to a Megatron torch_dist checkpoint.

    python tknp_megatron/tools/convert_hf_checkpoint.py --hf HF_DIR --out CKPT_DIR [--dtype bfloat16]

``config.json``'s ``model_type`` (``llama`` or ``nemotron``) picks the weight mapping.
Runs in one process (gloo, world 1) and holds one copy of the model in memory. The output
directory is served with ``--load CKPT_DIR --model-config CKPT_DIR/model_config.json``.
"""

from __future__ import annotations

import argparse
import os
import warnings

import torch.distributed as dist


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf", required=True, help="HF folder with config.json + *.safetensors")
    parser.add_argument("--out", required=True, help="output checkpoint directory")
    parser.add_argument("--dtype", default="bfloat16", help="float32 | bfloat16 | float16")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")

    import parallel_state as ps
    from tknp_megatron.config import dtype_from_name
    from tknp_megatron.launch import free_port, init_distributed
    from tknp_megatron.models.hf_convert import convert_hf_to_dist_checkpoint

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    init_distributed("gloo", 0, 1)
    try:
        ps.initialize_model_parallel(1)
        preset = convert_hf_to_dist_checkpoint(args.hf, args.out, dtype_from_name(args.dtype))
        ps.destroy_model_parallel()
    finally:
        dist.destroy_process_group()
    print(f"wrote {args.out}: {preset.num_layers} layers, hidden {preset.hidden_size}, "
          f"vocab {preset.vocab_size}")


if __name__ == "__main__":
    main()
