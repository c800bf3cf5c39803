"""Weights onto devices: streamed placement, sharding rules, the scanned block stack, and
LoRAs fused into each slice."""
