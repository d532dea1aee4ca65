"""The GPT model kind (decoder-only LMs on megatron's GPTModel): one file per family."""
