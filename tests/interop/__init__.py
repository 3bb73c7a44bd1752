"""Interoperability: Megatron-Core checkpoints and APIs, plain PyTorch DCP both ways."""
