"""Offload options, the per-process expert plan and placement state."""
