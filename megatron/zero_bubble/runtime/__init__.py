"""Runtime layer: executes one rank's schedule inside Megatron's training loop (torch)."""
