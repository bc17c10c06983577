"""Config, the shared Accelerate training loop, losses and checkpoints."""
