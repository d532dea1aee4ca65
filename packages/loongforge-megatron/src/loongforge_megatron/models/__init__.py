"""Model families of the megatron backend: the ModelSpec protocol, the registry, one folder per model kind."""
