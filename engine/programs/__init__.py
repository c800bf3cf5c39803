"""What is compiled and run: the denoising step, step caching, two-expert steps, the VAE
encode and decode programs, and the denoising loop with its timing protocol (denoise)."""
