"""Convert a Hugging Face Llama / Nemotron safetensors folder to a Megatron torch_dist checkpoint.

    python -m tknp_megatron.tools.convert_hf_checkpoint --hf HF_DIR --out CKPT_DIR [--dtype bfloat16]

The checkpoint keeps the folder's own dtype (``config.json``'s ``torch_dtype``) unless
``--dtype`` says otherwise, so serving it gives the same tokens as serving the folder
with ``--hf``.

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
    parser.add_argument("--dtype", default=None,
                        help="float32 | bfloat16 | float16 (default: the folder's own dtype)")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")

    import parallel_state as ps
    from tknp_megatron.config import dtype_from_name
    from tknp_megatron.launch import init_tool_process
    from tknp_megatron.models.hf_convert import convert_hf_to_dist_checkpoint, hf_checkpoint_dtype

    init_tool_process("cpu")  # a world of one
    try:
        ps.initialize_model_parallel(1)
        dtype = dtype_from_name(args.dtype) if args.dtype else hf_checkpoint_dtype(args.hf)
        preset = convert_hf_to_dist_checkpoint(args.hf, args.out, dtype)
        ps.destroy_model_parallel()
    finally:
        dist.destroy_process_group()
    print(f"wrote {args.out}: {preset.num_layers} layers, hidden {preset.hidden_size}, "
          f"vocab {preset.vocab_size}, {str(dtype).removeprefix('torch.')} "
          f"(model config: {os.path.join(args.out, 'model_config.json')})")


if __name__ == "__main__":
    main()
