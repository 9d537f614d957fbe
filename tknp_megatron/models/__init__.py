"""Model loading: Megatron stage models, checkpoints, Hugging Face conversion, seeded
weights, the non-TKNP reference and tokenizers."""
